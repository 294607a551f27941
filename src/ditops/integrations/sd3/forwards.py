"""The fused forwards of a patched SD3 / SD3.5 model: ``JointTransformerBlock`` on ditops'
adaLN ops (``adaln_zero.AdaLNOps``, one bundle per patched model) and
:class:`FusedSD3AttnProcessor`, SD3's joint attention with the q/k RMSNorms on
``rms_norm``. The arithmetic they reproduce is written out in
:mod:`ditops.integrations.sd3.family`, which checks a model and installs these.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ditops.integrations.shared.adaln_zero import (
    DOUBLE_BYPASSES,
    AdaLNOps,
    ada_emb,
    ada_modulate,
    mlp_half,
    norm_out_forward,
)
from ditops.integrations.shared.guard import Bypass, float64_call
from ditops.integrations.shared.processors import DenseProcessor

#: What the fused block computes without calling it (see :class:`~.guard.Bypass`); the
#: last block's ``norm2_context`` is None (``context_pre_only``), and stays watched as such.
JOINT_BYPASSES = DOUBLE_BYPASSES
#: The q/k norms the fused prologue computes without calling them (those not None).
QK_NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")


def _prologue_bypass(attn: nn.Module) -> Bypass:
    """The q/k norms present, each to be diffusers' RMSNorm with nothing attached."""
    from diffusers.models.normalization import RMSNorm

    return Bypass(tuple((n, RMSNorm) for n in QK_NORMS if getattr(attn, n, None) is not None))


def _feed_forward(block: nn.Module, ff: nn.Module) -> Any:
    """``ff``, or diffusers' chunked call of it while ``set_chunk_feed_forward`` is on."""
    if block._chunk_size is None:
        return ff
    from diffusers.models.attention import _chunked_feed_forward

    return functools.partial(
        _chunked_feed_forward, ff, chunk_dim=block._chunk_dim, chunk_size=block._chunk_size
    )


def joint_block_forward(
    block: nn.Module,
    ops: AdaLNOps,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    joint_attention_kwargs: dict[str, Any] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``JointTransformerBlock.forward`` on ditops' ops (see :mod:`ditops.integrations.sd3.family`):
    SD3's block, SD3.5's dual attention (``attn2``) and the last block (``context_pre_only``).

    Installed through :func:`~ditops.integrations.shared.guard.install_guarded`: it runs only
    while nothing is attached to the modules it bypasses (:data:`JOINT_BYPASSES`).
    """
    kw = joint_attention_kwargs or {}
    h = hidden_states
    if block.use_dual_attention:
        # SD35AdaLayerNormZeroX: one LayerNorm, modulated twice (the op norms each time:
        # the same values)
        emb = ada_emb(block.norm1, temb, 9)
        eps = block.norm1.norm.eps
        n = ops.modulate(h, emb[1][:, None], emb[0][:, None], eps)
        n2 = ops.modulate(h, emb[7][:, None], emb[6][:, None], eps)
    else:
        n, emb = ada_modulate(ops, block.norm1, h, temb, 6)
    c = encoder_hidden_states
    if block.context_pre_only:
        c_n = norm_out_forward(block.norm1_context, ops, c, temb)
    else:
        c_n, c_emb = ada_modulate(ops, block.norm1_context, c, temb, 6)
    attn_output, context_attn_output = block.attn(hidden_states=n, encoder_hidden_states=c_n, **kw)
    ff = _feed_forward(block, block.ff)
    if block.use_dual_attention:
        h = ops.residual(h, attn_output, emb[2].unsqueeze(1))
        attn_output2 = block.attn2(hidden_states=n2, **kw)
        # the second attention's gated residual is the one norm2 reads
        h = mlp_half(ops, h, attn_output2, (*emb[:2], emb[8], *emb[3:6]), block.norm2, ff)
    else:
        h = mlp_half(ops, h, attn_output, emb, block.norm2, ff)
    if block.context_pre_only:
        return None, h
    c_ff = _feed_forward(block, block.ff_context)
    c = mlp_half(ops, c, context_attn_output, c_emb, block.norm2_context, c_ff)
    return c, h


class FusedSD3AttnProcessor(DenseProcessor):
    """diffusers' ``JointAttnProcessor2_0`` with the q/k RMSNorms (per head) on ditops'
    ``rms_norm`` in diffusers' arithmetic (see :mod:`ditops.integrations.sd3.family`);
    everything else is that processor's code path, ``F.scaled_dot_product_attention``
    included (it takes no mask: neither does this).

    Built by diffusers' loaders as ``type(p)()``: then it is the original processor.
    A call in float64, or while a q/k norm is hooked or replaced since the patch, runs
    the original processor (it calls the norms).
    """

    #: The diffusers processor this class wraps: (module, class name).
    wraps = ("diffusers.models.attention_processor", "JointAttnProcessor2_0")

    # The parameters are the original's: diffusers' Attention passes a processor the
    # keyword arguments its __call__ names, so both receive the same ones.
    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        if (
            self.ops is None
            or float64_call(hidden_states)
            or _prologue_bypass(attn).problem(attn) is not None
        ):
            return self.original(
                attn, hidden_states, encoder_hidden_states, attention_mask, *args, **kwargs
            )
        B, H = hidden_states.shape[0], attn.heads
        query, key, value = (
            attn.to_q(hidden_states),
            attn.to_k(hidden_states),
            attn.to_v(hidden_states),
        )
        D = key.shape[-1] // H
        # Each norm on [B, L, H, D], then [B, H, L, D]: the values and the strides of
        # diffusers' norm of the transposed view.
        query = self._norm(attn.norm_q, query.view(B, -1, H, D)).transpose(1, 2)
        key = self._norm(attn.norm_k, key.view(B, -1, H, D)).transpose(1, 2)
        value = value.view(B, -1, H, D).transpose(1, 2)
        if encoder_hidden_states is not None:
            c = encoder_hidden_states
            c_q, c_k, c_v = attn.add_q_proj(c), attn.add_k_proj(c), attn.add_v_proj(c)
            c_q = self._norm(attn.norm_added_q, c_q.view(B, -1, H, D)).transpose(1, 2)
            c_k = self._norm(attn.norm_added_k, c_k.view(B, -1, H, D)).transpose(1, 2)
            c_v = c_v.view(B, -1, H, D).transpose(1, 2)
            query = torch.cat([query, c_q], dim=2)
            key = torch.cat([key, c_k], dim=2)
            value = torch.cat([value, c_v], dim=2)
        out = F.scaled_dot_product_attention(query, key, value, dropout_p=0.0, is_causal=False)
        out = out.transpose(1, 2).reshape(B, -1, H * D).to(query.dtype)
        context = None
        if encoder_hidden_states is not None:
            L = hidden_states.shape[1]
            out, context = out[:, :L], out[:, L:]
            if not attn.context_pre_only:
                context = attn.to_add_out(context)
        out = attn.to_out[1](attn.to_out[0](out))
        return out if context is None else (out, context)

    def _norm(self, norm: nn.Module | None, x: torch.Tensor) -> torch.Tensor:
        if norm is None:
            return x
        return self.ops.rms(x, norm.weight, norm.eps, "diffusers")  # type: ignore[union-attr]
