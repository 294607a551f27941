"""HunyuanVideo's fused block forwards (HunyuanVideo-1.5's double-stream block is the same
code): the arithmetic is written out in :mod:`ditops.integrations.hunyuan_video.family`.
The token-replace blocks' twins are in :mod:`~ditops.integrations.hunyuan_video.token_replace`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ditops.integrations.hunyuan_video.attention import single_stream_branches
from ditops.integrations.shared.adaln_zero import AdaLNOps, ada_modulate, mlp_half


def double_block_forward(
    block: nn.Module,
    ops: AdaLNOps,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    freqs_cis: tuple[torch.Tensor, torch.Tensor] | None = None,
    *args: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``HunyuanVideoTransformerBlock.forward`` on ditops' ops (see the module docstring).

    Installed through :func:`~ditops.integrations.shared.guard.install_guarded`; a deep copy of
    the block gets a partial bound to the copy and its own ops. Like diffusers', it
    ignores the token-replace arguments the model passes every block.
    """
    n, emb = ada_modulate(ops, block.norm1, hidden_states, temb, 6)
    attn_output, text = joint_attention(
        block, ops, n, encoder_hidden_states, temb, attention_mask, freqs_cis
    )
    hidden_states = mlp_half(ops, hidden_states, attn_output, emb, block.norm2, block.ff)
    return hidden_states, text_mlp_half(block, ops, encoder_hidden_states, *text)


def joint_attention(
    block: nn.Module,
    ops: AdaLNOps,
    n: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    attention_mask: torch.Tensor | None,
    freqs_cis: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, tuple[torch.Tensor, ...]]]:
    """A double-stream block's text-stream norm and its joint attention with the video's
    normed ``n``: the video's attention output, and the text's with its modulation (for
    :func:`text_mlp_half`). The token-replace block's video stream differs; its text
    stream is this one."""
    c_n, c_emb = ada_modulate(ops, block.norm1_context, encoder_hidden_states, temb, 6)
    attn_output, context_attn_output = block.attn(
        hidden_states=n,
        encoder_hidden_states=c_n,
        attention_mask=attention_mask,
        image_rotary_emb=freqs_cis,
    )
    return attn_output, (context_attn_output, c_emb)


def text_mlp_half(
    block: nn.Module, ops: AdaLNOps, text: torch.Tensor, attn: torch.Tensor, emb: Any
) -> torch.Tensor:
    """The double-stream block's text stream after :func:`joint_attention`."""
    return mlp_half(ops, text, attn, emb, block.norm2_context, block.ff_context)


def single_block_forward(
    block: nn.Module,
    ops: AdaLNOps,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    *args: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``HunyuanVideoSingleTransformerBlock.forward`` on ditops' ops (module docstring)."""
    text = encoder_hidden_states.shape[1]
    residual = torch.cat([hidden_states, encoder_hidden_states], dim=1)
    n, (_, _, gate) = ada_modulate(ops, block.norm, residual, temb, 3)
    out = single_stream_branches(block, n, text, attention_mask, image_rotary_emb)
    hidden_states = ops.residual(residual, out, gate.unsqueeze(1))
    return hidden_states[:, :-text], hidden_states[:, -text:]
