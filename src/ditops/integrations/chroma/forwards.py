"""The fused forwards of a patched Chroma model: the double- and single-stream blocks and
the output norm on ditops' adaLN ops (``adaln_zero.AdaLNOps``, one bundle per patched
model), their modulations read from the approximator's output (the pruned norms have no
projection). Attention is FLUX's processor, wrapped by FLUX's
:class:`~ditops.integrations.flux.forwards.FusedFluxAttnProcessor`. The arithmetic they
reproduce is written out in :mod:`ditops.integrations.chroma.family`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ditops.integrations.flux.forwards import clip_fp16, double_block_tail
from ditops.integrations.shared.adaln_zero import AdaLNOps

NORM_OUT_BYPASSES = ("norm",)


def pruned_modulate(
    ops: AdaLNOps, norm: nn.Module, x: torch.Tensor, emb: torch.Tensor, chunks: int
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """``norm(x, emb=emb)`` of a pruned adaLN-Zero norm (``chunks`` 6: the double block's,
    3: the single block's) on the modulate op: ``emb`` ``[B, chunks, C]`` chunked as
    diffusers does, ``x`` normed and modulated by its scale and shift; and the chunks."""
    chunked = emb.flatten(1, 2).chunk(chunks, dim=1)
    shift, scale = chunked[0], chunked[1]
    return ops.modulate(x, scale[:, None], shift[:, None], norm.norm.eps), chunked


def _pair_mask(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    # Chroma's blocks turn the [B, L] token mask into [B, 1, L, L], as here.
    if attention_mask is None:
        return None
    return attention_mask[:, None, None, :] * attention_mask[:, None, :, None]


def double_block_forward(
    block: nn.Module,
    ops: AdaLNOps,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    joint_attention_kwargs: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``ChromaTransformerBlock.forward`` on ditops' ops (see
    :mod:`ditops.integrations.chroma.family`); after attention, FLUX's double block."""
    n, emb = pruned_modulate(ops, block.norm1, hidden_states, temb[:, :6], 6)
    c_n, c_emb = pruned_modulate(ops, block.norm1_context, encoder_hidden_states, temb[:, 6:], 6)
    outputs = block.attn(
        hidden_states=n,
        encoder_hidden_states=c_n,
        image_rotary_emb=image_rotary_emb,
        attention_mask=_pair_mask(attention_mask),
        **(joint_attention_kwargs or {}),
    )
    return double_block_tail(block, ops, hidden_states, encoder_hidden_states, outputs, emb, c_emb)


def single_block_forward(
    block: nn.Module,
    ops: AdaLNOps,
    hidden_states: torch.Tensor,
    temb: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    joint_attention_kwargs: dict[str, Any] | None = None,
) -> torch.Tensor:
    """``ChromaSingleTransformerBlock.forward`` on ditops' ops (see
    :mod:`ditops.integrations.chroma.family`)."""
    n, (_, _, gate) = pruned_modulate(ops, block.norm, hidden_states, temb, 3)
    mlp_hidden_states = block.act_mlp(block.proj_mlp(n))
    attn_output = block.attn(
        hidden_states=n,
        image_rotary_emb=image_rotary_emb,
        attention_mask=_pair_mask(attention_mask),
        **(joint_attention_kwargs or {}),
    )
    out = block.proj_out(torch.cat([attn_output, mlp_hidden_states], dim=2))
    return clip_fp16(ops.residual(hidden_states, out, gate.unsqueeze(1)))


def norm_out_forward(
    norm: nn.Module, ops: AdaLNOps, x: torch.Tensor, emb: torch.Tensor
) -> torch.Tensor:
    """``ChromaAdaLayerNormContinuousPruned.forward`` (layer norm without affine) on
    ditops' op: shift first, then scale, cast to x's dtype."""
    shift, scale = torch.chunk(emb.flatten(1, 2).to(x.dtype), 2, dim=1)
    return ops.modulate(x, scale[:, None, :], shift[:, None, :], norm.norm.eps)
