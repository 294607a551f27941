"""The fused forward of a patched LTX-Video block and :class:`LTXSelfAttnProcessor`, LTX's
self-attention with the prologue on ``qk_norm_rope`` and optional block sparsity. The
arithmetic they reproduce is written out in :mod:`ditops.integrations.ltx_video.family`,
which checks a model and installs these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ditops.integrations.shared.guard import Bypass, float64_call
from ditops.integrations.shared.ops import QKOps
from ditops.integrations.shared.video_sparse import VideoSelfAttention
from ditops.ops.modulation_model_dtype import AdaLNResidualOp
from ditops.ops.qk_norm_rope import RMSNormOp
from ditops.ops.rms_norm_scale import RMSNormScaleOp

#: What the fused block computes without calling it (see :class:`~.guard.Bypass`).
BLOCK_BYPASSES = ("norm1", "norm2")
#: The q/k norms the fused prologue computes without calling them.
PROLOGUE_BYPASS = Bypass((("norm_q", nn.RMSNorm), ("norm_k", nn.RMSNorm)))


@dataclass(eq=False)
class LTXOps(QKOps):
    """The ops of one patched LTX model: ``rms_scale`` (diffusers' RMSNorm ``norm1`` /
    ``norm2`` with its modulation ``* (1 + c) + s``), ``rms`` (the RMSNorm alone: LTX-2),
    ``residual`` (the gated residuals) and ``qk`` (the self-attention prologue)."""

    rms: RMSNormOp
    rms_scale: RMSNormScaleOp
    residual: AdaLNResidualOp


def _modulated(
    ops: LTXOps, norm: nn.Module, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor
) -> torch.Tensor:
    """``norm(x) * (1 + scale) + shift``: diffusers' RMSNorm (no bias) and both steps in
    the model dtype, each rounded, on ``rms_norm_scale`` (``1 + scale`` as LTX adds it)."""
    return ops.rms_scale(x, 1 + scale, norm.eps, weight=norm.weight, shift=shift)  # type: ignore[no-any-return]


def block_forward(
    block: nn.Module,
    ops: LTXOps,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    encoder_attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``LTXVideoTransformerBlock.forward`` on ditops' ops (see
    :mod:`ditops.integrations.ltx_video.family`).

    Installed through :func:`~ditops.integrations.shared.guard.install_guarded`: it runs only
    while nothing is attached to the norms it bypasses (:data:`BLOCK_BYPASSES`).
    """
    batch_size = hidden_states.size(0)
    table = block.scale_shift_table
    ada = table[None, None].to(temb.device) + temb.reshape(
        batch_size, temb.size(1), table.shape[0], -1
    )
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = ada.unbind(dim=2)
    n = _modulated(ops, block.norm1, hidden_states, scale_msa, shift_msa)
    a = block.attn1(hidden_states=n, encoder_hidden_states=None, image_rotary_emb=image_rotary_emb)
    hidden_states = ops.residual(hidden_states, a, gate_msa)
    a = block.attn2(
        hidden_states,
        encoder_hidden_states=encoder_hidden_states,
        image_rotary_emb=None,
        attention_mask=encoder_attention_mask,
    )
    hidden_states = hidden_states + a
    n = _modulated(ops, block.norm2, hidden_states, scale_mlp, shift_mlp)
    return ops.residual(hidden_states, block.ff(n), gate_mlp)


def whole_row_qk(
    ops: Any, attn: nn.Module, query: torch.Tensor, key: torch.Tensor, rotary: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """``norm_q``/``norm_k`` and LTX's interleaved rotary on the ``qk`` op, ``[B, S, H * D]``
    in and out. The rotation covers all heads at once (``[B, S, H * D]`` tables): one
    "head" of ``H * D`` for the op, normed over it as ``norm_q``/``norm_k`` do. LTX's
    ``apply_rotary_emb`` rotates in fp32 whatever the tables' dtype: so does the op given
    fp32 tables."""
    cos, sin = (t.to(torch.float32).unsqueeze(2) for t in rotary)
    nq, nk = attn.norm_q, attn.norm_k
    query, key = ops.qk(
        query.unsqueeze(2), key.unsqueeze(2), nq.weight, nk.weight, cos, sin, nq.eps
    )
    return query.squeeze(2), key.squeeze(2)


class LTXSelfAttnProcessor(VideoSelfAttention):
    """diffusers' ``LTXVideoAttnProcessor`` on LTX's self-attention (``attn1``): the
    prologue (``norm_q``/``norm_k`` across heads, LTX's rotary) on ditops' ``qk_norm_rope``
    when ``ops`` is given, block-sparse attention on the sparse steps when ``sparse`` is.

    Everything else is the wrapped processor's code path: a call with text keys, a mask,
    no rotary tables or tables of another shape, or a float64 call, runs the original;
    so does a dense step without ``ops``. Norms hooked or replaced since the patch are
    called as modules (their hooks run). The attention backend and context-parallel config
    are the original's (see :class:`~ditops.integrations.shared.processors.WrappingProcessor`).
    """

    #: The diffusers processor this class wraps: (module, class name).
    wraps = ("diffusers.models.transformers.transformer_ltx", "LTXVideoAttnProcessor")

    def _fused_prologue(self, attn: nn.Module, x: torch.Tensor, rotary: Any) -> bool:
        cos = rotary[0]
        return (
            self.ops is not None
            and cos.dim() == 3
            and tuple(cos.shape[1:]) == (x.shape[1], attn.inner_dim)
            and PROLOGUE_BYPASS.problem(attn) is None
        )

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        args = (attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        if (
            float64_call(hidden_states)
            or encoder_hidden_states is not None
            or attention_mask is not None
            or image_rotary_emb is None
        ):
            return self.original(*args)
        prologue = self._fused_prologue(attn, hidden_states, image_rotary_emb)
        if not prologue and not self.own_attention():
            return self.original(*args)
        from diffusers.models.transformers import transformer_ltx as tl

        query = attn.to_q(hidden_states)
        key = attn.to_k(hidden_states)
        value = attn.to_v(hidden_states)
        heads = attn.heads
        if prologue:
            query, key = whole_row_qk(self.ops, attn, query, key, image_rotary_emb)
        else:
            query = tl.apply_rotary_emb(attn.norm_q(query), image_rotary_emb)
            key = tl.apply_rotary_emb(attn.norm_k(key), image_rotary_emb)
        query, key, value = (t.unflatten(2, (heads, -1)) for t in (query, key, value))
        out = self.attend(query, key, value)
        out = out.flatten(2, 3).to(query.dtype)
        out = attn.to_out[0](out)
        return attn.to_out[1](out)
