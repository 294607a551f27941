"""The fused forwards of a patched Mochi model: ``MochiTransformerBlock`` with its
modulated RMSNorms on ditops' ``rms_norm_scale`` (the rest of each expression as Mochi
writes it), and :class:`FusedMochiAttnProcessor`, Mochi's joint attention with the q/k prologue
on ``qk_norm_rope`` / ``rms_norm`` and optional block-sparse attention. The arithmetic
they reproduce is written out in :mod:`ditops.integrations.mochi.family`, which checks a
model and installs these.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ditops.integrations.shared.adaln_zero import AdaLNOps
from ditops.integrations.shared.guard import Bypass, float64_call
from ditops.integrations.shared.joint_sparse import joint_sparse_attention
from ditops.integrations.shared.processors import WrappingProcessor
from ditops.integrations.shared.steps import runs_dense
from ditops.tracing import refuse_under_fullgraph, traced

#: What the fused block computes without calling it (see :class:`~.guard.Bypass`); the
#: context ones the last block (``context_pre_only``) lacks are not watched there.
BYPASSES = (
    "norm1",
    "norm1.norm",
    "norm1_context",
    "norm1_context.norm",
    "norm1_context.norm.norm",
    "norm2",
    "norm2.norm",
    "norm3",
    "norm3.norm",
    "norm4",
    "norm4.norm",
    "norm2_context",
    "norm2_context.norm",
    "norm3_context",
    "norm3_context.norm",
    "norm4_context",
    "norm4_context.norm",
)
QK_NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")


def modulated(ops: AdaLNOps, norm: nn.Module, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``MochiModulatedRMSNorm(x, scale)``: ``(rms(x.float()) * scale).to(x.dtype)``, the
    ``rms_norm_scale`` op's ``upcast=True``."""
    return ops.rms_scale(x, scale, norm.norm.eps, upcast=True)  # type: ignore[no-any-return]


def _zero(
    ops: AdaLNOps, norm: nn.Module, x: torch.Tensor, temb: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """``MochiRMSNormZero(x, temb)``: the normed ``x`` and the gate / MLP scale / gate."""
    scale_msa, gate_msa, scale_mlp, gate_mlp = norm.linear(norm.silu(temb)).chunk(4, dim=1)
    n = modulated(ops, norm, x, 1 + scale_msa[:, None].to(torch.float32))
    return n, gate_msa, scale_mlp, gate_mlp


def _continuous(
    ops: AdaLNOps, norm: nn.Module, x: torch.Tensor, temb: torch.Tensor
) -> torch.Tensor:
    """``MochiLayerNormContinuous(x, temb)`` (the last block's text norm)."""
    scale = norm.linear_1(norm.silu(temb).to(x.dtype))
    return modulated(ops, norm.norm, x, 1 + scale.unsqueeze(1).to(torch.float32)).to(x.dtype)


def _rest(
    ops: AdaLNOps, block: nn.Module, h: torch.Tensor, a: torch.Tensor, gates: tuple, suffix: str
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
    ops: AdaLNOps,
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


def mochi_tables(
    rope: Any, tokens: int, heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """MochiRoPE's ``(cos, sin)``, ``[L, H, D/2]`` each, or None where ditops would not
    rotate as Mochi does: no tables, another shape, fp64 (Mochi then rotates in fp64;
    bf16/fp16 tables it widens to fp32, as ditops does)."""
    if rope is None or len(rope) != 2:
        return None
    cos, sin = rope
    shape = (tokens, heads, head_dim // 2)
    if tuple(cos.shape) != shape or tuple(sin.shape) != shape or sin.dtype != cos.dtype:
        return None
    if cos.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    return cos, sin


def mochi_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Mochi's rotation (its processor's inner ``apply_rotary_emb``): interleaved pairs
    turned in fp32, each member rounded once. The prologue without ditops' ops."""
    x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
    out1 = (x1 * cos - x2 * sin).to(x.dtype)
    out2 = (x1 * sin + x2 * cos).to(x.dtype)
    return torch.stack([out1, out2], dim=-1).flatten(-2)


def _qk_bypass() -> Bypass:
    from diffusers.models.normalization import MochiRMSNorm

    return Bypass(tuple((name, MochiRMSNorm) for name in QK_NORMS))


class FusedMochiAttnProcessor(WrappingProcessor):
    """diffusers' ``MochiAttnProcessor2_0`` (joint video + text attention, text last, each
    sample's padded text left out) with the q/k prologue on ditops' ops (``ops``; None:
    Mochi's own norms and rotation) and optional block-sparse attention (``sparse``, with
    the model's ``steps``): the video tokens' RMSNorm and rotation on ``qk_norm_rope``,
    the text tokens' RMSNorm on ``rms_norm``; dense steps attend as Mochi does. Calls
    without Mochi's rotary tables run the original processor."""

    #: The diffusers processor this class wraps: (module, class name).
    wraps = ("diffusers.models.attention_processor", "MochiAttnProcessor2_0")

    ops: AdaLNOps | None

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor,
        image_rotary_emb: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.sparse is not None and traced():
            refuse_under_fullgraph(
                "ditops: Mochi's sparse attention cannot compile with fullgraph=True: it "
                "reads each sample's text mask on the host (as Mochi's own attention does)"
            )
        dense = runs_dense(self.sparse, self.steps)
        ops = None if self.ops is None or _qk_bypass().problem(attn) else self.ops
        tables = mochi_tables(
            image_rotary_emb, hidden_states.shape[1], attn.heads, attn.inner_dim // attn.heads
        )
        if float64_call(hidden_states) or tables is None or (dense and ops is None):
            return self.original(
                attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb
            )
        query, key, value = _heads(attn, hidden_states, attn.to_q, attn.to_k, attn.to_v)
        e_query, e_key, e_value = _heads(
            attn, encoder_hidden_states, attn.add_q_proj, attn.add_k_proj, attn.add_v_proj
        )
        query, key, e_query, e_key = _prologue(ops, attn, query, key, e_query, e_key, tables)
        video, text = query.shape[1], e_query.shape[1]
        keep = _text_kept(attention_mask, query.shape[0], text)
        if dense or keep is None:
            out = per_sample_attention(query, key, value, e_query, e_key, e_value, attention_mask)
        else:
            assert self.sparse is not None and self.steps is not None
            q, k, v = (
                torch.cat(p, dim=1) for p in ((query, e_query), (key, e_key), (value, e_value))
            )
            rows = torch.cat([keep.new_ones(keep.shape[0], video), keep], dim=1)[:, None, None]
            out = joint_sparse_attention(
                self.sparse,
                self.steps,
                q,
                k,
                v,
                text,
                _attend_kept,
                text_first=False,
                keep=keep,
                text_rows_mask=rows,
            )
            # Mochi's padded text rows attend to nothing: their output is zero
            t_out = torch.where(keep[:, :, None, None], out[:, video:], 0)
            out = torch.cat([out[:, :video], t_out], dim=1).flatten(2, 3)
        hidden_states, encoder_hidden_states = out.split_with_sizes((video, text), dim=1)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        if hasattr(attn, "to_add_out"):
            encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        return hidden_states, encoder_hidden_states


def _heads(attn: nn.Module, x: torch.Tensor, *projections: nn.Module) -> tuple[torch.Tensor, ...]:
    return tuple(f(x).unflatten(2, (attn.heads, -1)) for f in projections)


def _prologue(
    ops: AdaLNOps | None,
    attn: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    e_query: torch.Tensor,
    e_key: torch.Tensor,
    tables: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, ...]:
    """The video q/k normed and rotated, the text q/k normed: on ditops' ops, or (``ops``
    None: a sparse step without the fused prologue) Mochi's own modules."""
    nq, nk, tq, tk = (getattr(attn, name) for name in QK_NORMS)
    if ops is None:
        q, k = (mochi_rotate(n(t), *tables) for n, t in ((nq, query), (nk, key)))
        return q, k, tq(e_query), tk(e_key)
    # the heads as the op's batch: Mochi's tables are per head ([H, L, 1, D/2]), the
    # norm per row; rotation in fp32 as Mochi's (bf16/fp16 tables widened exactly)
    cos, sin = (t.to(query.device, torch.float32).permute(1, 0, 2).unsqueeze(2) for t in tables)
    q, k = ops.qk(
        query.permute(2, 1, 0, 3), key.permute(2, 1, 0, 3), nq.weight, nk.weight, cos, sin, nq.eps
    )
    e_query, e_key = ops.rms(e_query, tq.weight, tq.eps), ops.rms(e_key, tk.weight, tk.eps)
    return q.permute(2, 1, 0, 3), k.permute(2, 1, 0, 3), e_query, e_key


def _text_kept(mask: Any, batch: int, text: int) -> torch.Tensor | None:
    """The text tokens Mochi keeps (its mask's nonzero entries), bool ``[B, text]``, or
    None for a mask of another shape (then the attention runs as Mochi's, dense)."""
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (batch, text):
        return None
    return mask != 0


def _attend_kept(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kept: torch.Tensor | None
) -> torch.Tensor:
    """Dense attention as Mochi's: per sample, SDPA over the keys ``kept`` keeps (bool
    ``[B, 1, 1, N]``; None: all), the others left out, not masked. ``[B, S, H, D]``."""
    outs = []
    for b in range(q.shape[0]):
        cols = slice(None) if kept is None else kept[b].flatten()
        qb, kb, vb = (t[b : b + 1].transpose(1, 2) for t in (q, k[:, cols], v[:, cols]))
        out = F.scaled_dot_product_attention(qb, kb, vb, dropout_p=0.0, is_causal=False)
        outs.append(out.transpose(1, 2))
    return torch.cat(outs, dim=0)


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
