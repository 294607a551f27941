"""The fused forwards of a patched Mochi model: ``MochiTransformerBlock`` with its
modulated RMSNorms on ditops' ``rms_norm`` (the rest of each expression as Mochi writes
it), and :class:`FusedMochiAttnProcessor`, Mochi's joint attention with the q/k prologue
on ``qk_norm_rope`` / ``rms_norm``. The arithmetic they reproduce is written out in
:mod:`ditops.integrations.mochi.family`, which checks a model and installs these.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ditops.integrations.shared.base import WrappingProcessor
from ditops.integrations.shared.guard import Bypass, float64_call
from ditops.integrations.shared.ops import Ops

#: What the fused block computes without calling it (see :class:`~.guard.Bypass`); the
#: context ones the last block (``context_pre_only``) lacks are not watched there.
BYPASSES = (
    "norm1", "norm1.norm", "norm1_context", "norm1_context.norm", "norm1_context.norm.norm",
    "norm2", "norm2.norm", "norm3", "norm3.norm", "norm4", "norm4.norm",
    "norm2_context", "norm2_context.norm", "norm3_context", "norm3_context.norm",
    "norm4_context", "norm4_context.norm",
)  # fmt: skip
QK_NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")


def _rms(ops: Ops, x: torch.Tensor, eps: float) -> torch.Tensor:
    """diffusers' ``RMSNorm(0, eps, False)`` of ``x.to(float32)`` (fp32 out): the
    ``rms_norm`` op's ``"diffusers"`` convention without a weight is that code."""
    return ops.rms(x.to(torch.float32), None, eps, convention="diffusers")  # type: ignore[no-any-return]


def modulated(ops: Ops, norm: nn.Module, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``MochiModulatedRMSNorm(x, scale)``: ``(rms(x.float()) * scale).to(x.dtype)``."""
    return (_rms(ops, x, norm.norm.eps) * scale).to(x.dtype)


def _zero(
    ops: Ops, norm: nn.Module, x: torch.Tensor, temb: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """``MochiRMSNormZero(x, temb)``: the normed ``x`` and the gate / MLP scale / gate."""
    scale_msa, gate_msa, scale_mlp, gate_mlp = norm.linear(norm.silu(temb)).chunk(4, dim=1)
    n = _rms(ops, x, norm.norm.eps) * (1 + scale_msa[:, None].to(torch.float32))
    return n.to(x.dtype), gate_msa, scale_mlp, gate_mlp


def _continuous(ops: Ops, norm: nn.Module, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
    """``MochiLayerNormContinuous(x, temb)`` (the last block's text norm)."""
    scale = norm.linear_1(norm.silu(temb).to(x.dtype))
    return modulated(ops, norm.norm, x, 1 + scale.unsqueeze(1).to(torch.float32)).to(x.dtype)


def _rest(
    ops: Ops, block: nn.Module, h: torch.Tensor, a: torch.Tensor, gates: tuple, suffix: str
) -> torch.Tensor:
    """One stream after attention: the gated residual, the MLP's modulated norm, the MLP
    and its gated residual (``suffix`` "" for the video stream, "_context" for text)."""
    gate_msa, scale_mlp, gate_mlp = gates
    norm2, norm3, norm4 = (getattr(block, f"norm{i}{suffix}") for i in (2, 3, 4))
    h = h + modulated(ops, norm2, a, torch.tanh(gate_msa).unsqueeze(1))
    n = modulated(ops, norm3, h, (1 + scale_mlp.unsqueeze(1).to(torch.float32)))
    ff = block.ff_context if suffix else block.ff
    return h + modulated(ops, norm4, ff(n), torch.tanh(gate_mlp).unsqueeze(1))


def block_forward(
    block: nn.Module,
    ops: Ops,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    encoder_attention_mask: torch.Tensor,
    image_rotary_emb: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``MochiTransformerBlock.forward`` with its RMSNorms on ditops' op (see
    :mod:`ditops.integrations.mochi.family`); runs only while nothing is attached to the
    norms it bypasses (:data:`BYPASSES`)."""
    n, *gates = _zero(ops, block.norm1, hidden_states, temb)
    if not block.context_pre_only:
        c_n, *c_gates = _zero(ops, block.norm1_context, encoder_hidden_states, temb)
    else:
        c_n = _continuous(ops, block.norm1_context, encoder_hidden_states, temb)
    a, c_a = block.attn1(
        hidden_states=n,
        encoder_hidden_states=c_n,
        image_rotary_emb=image_rotary_emb,
        attention_mask=encoder_attention_mask,
    )
    hidden_states = _rest(ops, block, hidden_states, a, tuple(gates), "")
    if not block.context_pre_only:
        encoder_hidden_states = _rest(
            ops, block, encoder_hidden_states, c_a, tuple(c_gates), "_context"
        )
    return hidden_states, encoder_hidden_states


def mochi_tables(rope: Any, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """MochiRoPE's ``[L, H, D/2]`` tables as ``qk_norm_rope`` takes them with the heads as
    its batch (``[H, L, 1, D/2]``, fp32), or None where the op would not compute what
    Mochi's rotation does (no tables, another shape, fp64: Mochi then rotates in fp64)."""
    if rope is None or len(rope) != 2:
        return None
    cos, sin = rope
    _, L, H, D = query.shape
    if tuple(cos.shape) != (L, H, D // 2) or tuple(sin.shape) != (L, H, D // 2):
        return None
    if cos.dtype not in (torch.float32, torch.bfloat16, torch.float16) or sin.dtype != cos.dtype:
        return None
    return tuple(  # type: ignore[return-value]
        t.to(query.device, torch.float32).permute(1, 0, 2).unsqueeze(2) for t in (cos, sin)
    )


def _qk_bypass() -> Bypass:
    from diffusers.models.normalization import MochiRMSNorm

    return Bypass(tuple((name, MochiRMSNorm) for name in QK_NORMS))


class FusedMochiAttnProcessor(WrappingProcessor):
    """diffusers' ``MochiAttnProcessor2_0`` (joint video + text attention, text last, each
    sample's padded text left out) with the q/k prologue on ditops' ops: the video
    tokens' RMSNorm and rotation on ``qk_norm_rope``, the text tokens' RMSNorm on
    ``rms_norm``; the rest is Mochi's code path. Calls without Mochi's rotary tables run
    the original."""

    #: The diffusers processor this class wraps: (module, class name).
    wraps = ("diffusers.models.attention_processor", "MochiAttnProcessor2_0")

    def __init__(
        self,
        original: Any | None = None,
        ops: Ops | None = None,
        steps: Any = None,
        sparse: Any = None,
    ) -> None:
        if original is None:  # built as diffusers' loaders build processors: type(p)()
            original = self.original_processor()
        if sparse is not None:
            raise ValueError("FusedMochiAttnProcessor: no sparse attention for Mochi yet")
        super().__init__(original)
        self.ops = ops

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor,
        image_rotary_emb: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.ops is None or float64_call(hidden_states) or _qk_bypass().problem(attn):
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask,
                                 image_rotary_emb)  # fmt: skip
        query, key, value = (
            f(hidden_states).unflatten(2, (attn.heads, -1))
            for f in (attn.to_q, attn.to_k, attn.to_v)
        )
        tables = mochi_tables(image_rotary_emb, query)
        if tables is None:
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask,
                                 image_rotary_emb)  # fmt: skip
        nq, nk = attn.norm_q, attn.norm_k
        # heads as the op's batch: the tables are per head, the norm per row
        query, key = (
            t.permute(2, 1, 0, 3)
            for t in self.ops.qk(query.permute(2, 1, 0, 3), key.permute(2, 1, 0, 3),
                                 nq.weight, nk.weight, *tables, nq.eps)
        )  # fmt: skip
        e_query, e_key, e_value = (
            f(encoder_hidden_states).unflatten(2, (attn.heads, -1))
            for f in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
        )
        rms, nq, nk = self.ops.rms, attn.norm_added_q, attn.norm_added_k
        e_query, e_key = rms(e_query, nq.weight, nq.eps), rms(e_key, nk.weight, nk.eps)
        hidden_states = per_sample_attention(
            query, key, value, e_query, e_key, e_value, attention_mask
        )
        hidden_states, encoder_hidden_states = hidden_states.split_with_sizes(
            (query.shape[1], e_query.shape[1]), dim=1
        )
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        if hasattr(attn, "to_add_out"):
            encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        return hidden_states, encoder_hidden_states


def per_sample_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    e_query: torch.Tensor,
    e_key: torch.Tensor,
    e_value: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    """Mochi's attention, as its processor computes it: per sample, SDPA over ``[video,
    the text tokens the mask keeps]``, the padded text rows' output zero. ``[B, L, H,
    D]`` in, ``[B, L + T, H * D]`` out."""
    query, key, value, e_query, e_key, e_value = (
        t.transpose(1, 2) for t in (query, key, value, e_query, e_key, e_value)
    )
    total = query.shape[2] + e_query.shape[2]
    outs = []
    for b in range(query.shape[0]):
        valid = torch.nonzero(mask[b][None, :].flatten(), as_tuple=False).flatten()
        q, k, v = (
            torch.cat([t[b : b + 1], e[b : b + 1, :, valid, :]], dim=2)
            for t, e in ((query, e_query), (key, e_key), (value, e_value))
        )
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=False)
        outs.append(F.pad(out, (0, 0, 0, total - out.size(2))))
    return torch.cat(outs, dim=0).transpose(1, 2).flatten(2, 3)
