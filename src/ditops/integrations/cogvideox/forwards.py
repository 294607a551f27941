"""The fused forwards of a patched CogVideoX model: ``CogVideoXBlock`` and the output norm
on ditops' modulation ops (:class:`CogVideoXOps`, one bundle per patched model), and
:class:`CogVideoXAttnProcessor`, CogVideoX's joint attention with the rotary embedding on
ditops' op and optional block-sparse attention. The arithmetic they reproduce, and which
op takes which expression in which dtype, is written out in
:mod:`ditops.integrations.cogvideox.family`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ditops.integrations.shared.guard import float64_call
from ditops.integrations.shared.joint_sparse import joint_sparse_attention
from ditops.integrations.shared.ops import Ops
from ditops.integrations.shared.processors import WrappingProcessor
from ditops.integrations.shared.steps import runs_dense
from ditops.ops.modulation_fp32 import LayerNormScaleShiftOp, ScaleResidualLayerNormScaleShiftOp
from ditops.ops.modulation_model_dtype import (
    AdaLNModulateOp,
    AdaLNResidualModulateOp,
    AdaLNResidualOp,
)
from ditops.ops.qk_norm_rope import RotaryEmbeddingOp

logger = logging.getLogger("ditops")

#: What each fused forward computes without calling it (see ``guard.Bypass``).
BLOCK_BYPASSES = ("norm1", "norm1.norm", "norm2", "norm2.norm")
NORM_OUT_BYPASSES = ("norm",)


@dataclass(eq=False)
class CogVideoXOps(Ops):
    """The ops of one patched CogVideoX model: the model-dtype adaLN ops (norms without
    affine), the fp32 chain (affine norms) and ``rope``."""

    modulate: AdaLNModulateOp
    residual: AdaLNResidualOp
    residual_modulate: AdaLNResidualModulateOp
    ln_modulate: LayerNormScaleShiftOp
    residual_ln_modulate: ScaleResidualLayerNormScaleShiftOp
    rope: RotaryEmbeddingOp


def _fp32_chain(ops: CogVideoXOps, x: torch.Tensor) -> bool:
    """Whether an affine norm's chain goes on the fp32 ops: in fp32 they are bitwise
    diffusers' expression; in bf16/fp16 only in fast precision (they round once)."""
    return x.dtype == torch.float32 or ops.ln_modulate.resolved_precision() == "fast"


def modulate(
    ops: CogVideoXOps, norm: nn.LayerNorm, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor
) -> torch.Tensor:
    """``norm(x) * (1 + scale) + shift`` (``scale``, ``shift``: ``[B, 1, C]``)."""
    if not norm.elementwise_affine:
        return ops.modulate(x, scale, shift, norm.eps)
    if _fp32_chain(ops, x):
        return ops.ln_modulate(x, norm.weight, norm.bias, scale, shift, norm.eps)
    return norm(x) * (1 + scale) + shift  # no op rounds as eager does with the affine


def residual_modulate(
    ops: CogVideoXOps,
    norm: nn.LayerNorm,
    h: torch.Tensor,
    x: torch.Tensor,
    gate: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = h + gate * x``, then ``(norm(h) * (1 + scale) + shift, h)``."""
    if not norm.elementwise_affine:
        return ops.residual_modulate(h, x, gate, scale, shift, norm.eps)
    if _fp32_chain(ops, x):
        return ops.residual_ln_modulate(h, x, gate, norm.weight, norm.bias, scale, shift, norm.eps)
    h = ops.residual(h, x, gate)
    return norm(h) * (1 + scale) + shift, h


def block_forward(
    block: nn.Module,
    ops: CogVideoXOps,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_kwargs: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``CogVideoXBlock.forward`` on ditops' ops (see :mod:`~ditops.integrations.cogvideox.family`).

    Installed through :func:`~ditops.integrations.shared.guard.install_guarded`: it runs only
    while nothing is attached to the modules it bypasses (:data:`BLOCK_BYPASSES`).
    """
    text = encoder_hidden_states.size(1)
    norm1, norm2 = block.norm1, block.norm2
    shift, scale, gate, e_shift, e_scale, e_gate = norm1.linear(norm1.silu(temb)).chunk(6, dim=1)
    n = modulate(ops, norm1.norm, hidden_states, scale[:, None, :], shift[:, None, :])
    e_n = modulate(ops, norm1.norm, encoder_hidden_states, e_scale[:, None, :], e_shift[:, None, :])
    attn_h, attn_e = block.attn1(
        hidden_states=n,
        encoder_hidden_states=e_n,
        image_rotary_emb=image_rotary_emb,
        **(attention_kwargs or {}),
    )
    shift, scale, gate_ff, e_shift, e_scale, e_gate_ff = norm2.linear(norm2.silu(temb)).chunk(
        6, dim=1
    )
    n, hidden_states = residual_modulate(
        ops,
        norm2.norm,
        hidden_states,
        attn_h,
        gate[:, None, :],
        scale[:, None, :],
        shift[:, None, :],
    )
    e_n, encoder_hidden_states = residual_modulate(
        ops,
        norm2.norm,
        encoder_hidden_states,
        attn_e,
        e_gate[:, None, :],
        e_scale[:, None, :],
        e_shift[:, None, :],
    )
    ff_output = block.ff(torch.cat([e_n, n], dim=1))
    hidden_states = ops.residual(hidden_states, ff_output[:, text:], gate_ff[:, None, :])
    encoder_hidden_states = ops.residual(
        encoder_hidden_states, ff_output[:, :text], e_gate_ff[:, None, :]
    )
    return hidden_states, encoder_hidden_states


def norm_out_forward(
    norm: nn.Module,
    ops: CogVideoXOps,
    x: torch.Tensor,
    timestep: torch.Tensor | None = None,
    temb: torch.Tensor | None = None,
) -> torch.Tensor:
    """``AdaLayerNorm.forward`` with ``chunk_dim=1`` and no timestep embedding (CogVideoX's
    ``norm_out``), its modulated norm on ditops' ops."""
    shift, scale = norm.linear(norm.silu(temb)).chunk(2, dim=1)
    return modulate(ops, norm.norm, x, scale[:, None, :], shift[:, None, :])


def _sdpa_bsnd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """CogVideoX's dense attention (``F.scaled_dot_product_attention``) on ``[B, S, H, D]``."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)


class CogVideoXAttnProcessor(WrappingProcessor):
    """diffusers' ``CogVideoXAttnProcessor2_0`` with the rotary embedding on ditops' op
    (``ops``; None: diffusers' ``apply_rotary_emb``) and optional block-sparse attention
    (``sparse``, with the model's ``steps``): text queries dense over all keys, video
    queries block-sparse over [text keys, video keys], the text and the first frame's keys
    dense (:func:`~ditops.integrations.shared.joint_sparse.joint_sparse_attention`).

    Calls it was not written for run the original processor: an attention mask (the
    model passes none; on a sparse step such a call runs dense, with a warning once),
    cross-attention, a float64 call, and dense calls without rotary tables ``[S, D]``
    (nothing of them is fused).
    """

    #: The diffusers processor this class wraps: (module, class name).
    wraps = ("diffusers.models.attention_processor", "CogVideoXAttnProcessor2_0")

    ops: CogVideoXOps | None
    said_mask = False  # warned once that a mask made a sparse step run dense

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dense = runs_dense(self.sparse, self.steps)
        rope = (
            self.ops is not None and image_rotary_emb is not None and image_rotary_emb[0].dim() == 2
        )
        if attention_mask is not None and not dense and not self.said_mask:
            self.said_mask = True
            logger.warning(
                "ditops: a CogVideoX attention call with an attention mask runs dense attention "
                "with the mask on sparse steps too: block-sparse attention takes no mask"
            )
        if (
            float64_call(hidden_states)  # cast after the patch: the meaning, dense
            or attention_mask is not None
            or attn.is_cross_attention
            or (dense and not rope)
        ):
            return self.original(
                attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb
            )
        text = encoder_hidden_states.size(1)
        query, key, value = self._qkv(attn, hidden_states, encoder_hidden_states, image_rotary_emb)
        batch, heads, _, head_dim = query.shape
        if dense:  # as diffusers calls it
            out = F.scaled_dot_product_attention(
                query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False
            ).transpose(1, 2)
        else:
            assert self.sparse is not None and self.steps is not None
            q, k, v = (t.transpose(1, 2) for t in (query, key, value))
            out = joint_sparse_attention(
                self.sparse, self.steps, q, k, v, text, _sdpa_bsnd, text_first=True
            )
        out = out.reshape(batch, -1, heads * head_dim)
        out = attn.to_out[1](attn.to_out[0](out))
        encoder_hidden_states, hidden_states = out.split([text, out.size(1) - text], dim=1)
        return hidden_states, encoder_hidden_states

    def _qkv(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v ``[B, H, N, D]`` as ``CogVideoXAttnProcessor2_0`` makes them: text rows
        first, q/k normed by the attention's own norms (all rows), video rows rotated."""
        text = encoder_hidden_states.size(1)
        x = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        batch = x.shape[0]
        query, key, value = attn.to_q(x), attn.to_k(x), attn.to_v(x)
        head_dim = key.shape[-1] // attn.heads
        query, key, value = (
            t.view(batch, -1, attn.heads, head_dim).transpose(1, 2) for t in (query, key, value)
        )
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        if rotary is not None:
            query[:, :, text:] = self._rotate(query[:, :, text:], rotary)
            key[:, :, text:] = self._rotate(key[:, :, text:], rotary)
        return query, key, value

    def _rotate(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``apply_rotary_emb(x, rotary)`` on ``[B, H, S, D]`` rows: ditops' op given 2-D
        tables (in fp32: apply_rotary_emb rotates in fp32 whatever their dtype), else
        diffusers' function."""
        if self.ops is None or rotary[0].dim() != 2:
            from diffusers.models.embeddings import apply_rotary_emb

            return apply_rotary_emb(x, rotary)
        cos, sin = (t.to(x.device, torch.float32) for t in rotary)
        return self.ops.rope(x.transpose(1, 2), cos, sin).transpose(1, 2)
