"""The fused forwards of a patched FLUX model: the double- and single-stream blocks and
on ditops' adaLN ops (``adaln_zero.adaln_ops``, one bundle per patched model), and
:class:`FusedFluxAttnProcessor`, FLUX's attention with the prologue on ``qk_norm_rope``.
The arithmetic they reproduce is written out in :mod:`ditops.integrations.flux.family`, which
checks a model and installs these (through
:func:`~ditops.integrations.shared.guard.install_guarded`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ditops.integrations.shared.adaln_zero import ada_modulate, mlp_half
from ditops.integrations.shared.base import DenseProcessor
from ditops.integrations.shared.guard import Bypass, float64_call
from ditops.integrations.shared.ops import Ops

#: FLUX clips fp16 activations to the largest finite fp16 after some residual adds.
FP16_MAX = 65504.0

#: What each fused forward computes without calling it (see :class:`~.guard.Bypass`).
DOUBLE_BYPASSES = ("norm1", "norm1.norm", "norm1_context", "norm1_context.norm", "norm2",
                   "norm2_context")  # fmt: skip
SINGLE_BYPASSES = ("norm", "norm.norm")
NORM_OUT_BYPASSES = ("norm",)


def _prologue_bypass(attn: nn.Module) -> Bypass:
    names = ["norm_q", "norm_k"]
    if getattr(attn, "added_kv_proj_dim", None) is not None:
        names += ["norm_added_q", "norm_added_k"]
    return Bypass(tuple((name, nn.RMSNorm) for name in names))


def clip_fp16(h: torch.Tensor) -> torch.Tensor:
    """FLUX's (and Chroma's) own guard, in its own place (after the residual adds it
    names): fp16 activations clipped to the largest finite fp16."""
    if h.dtype == torch.float16:
        return h.clip(-FP16_MAX, FP16_MAX)
    return h


def double_block_forward(
    block: nn.Module,
    ops: Ops,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    joint_attention_kwargs: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``FluxTransformerBlock.forward`` on ditops' ops (see :mod:`ditops.integrations.flux.family`).

    Installed through :func:`~ditops.integrations.shared.guard.install_guarded`: it runs only
    while nothing is attached to the modules it bypasses (:data:`DOUBLE_BYPASSES`).
    """
    n, emb = ada_modulate(ops, block.norm1, hidden_states, temb, 6)
    c_n, c_emb = ada_modulate(ops, block.norm1_context, encoder_hidden_states, temb, 6)
    outputs = block.attn(
        hidden_states=n,
        encoder_hidden_states=c_n,
        image_rotary_emb=image_rotary_emb,
        **(joint_attention_kwargs or {}),
    )
    return double_block_tail(block, ops, hidden_states, encoder_hidden_states, outputs, emb, c_emb)


def double_block_tail(
    block: nn.Module,
    ops: Ops,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    outputs: tuple[torch.Tensor, ...],
    emb: tuple[torch.Tensor, ...],
    c_emb: tuple[torch.Tensor, ...],
) -> tuple[torch.Tensor, torch.Tensor]:
    """A double-stream block after its attention (FLUX's, Chroma's): each stream's gated
    residual, modulated ``norm2``, feed-forward and gated residual, IP-Adapter's output
    added to the image stream, the text stream clipped in fp16. ``emb``/``c_emb``: each
    stream's six modulation chunks."""
    if len(outputs) == 2:
        attn_output, context_attn_output = outputs
        ip_attn_output = None
    elif len(outputs) == 3:
        attn_output, context_attn_output, ip_attn_output = outputs
    else:
        raise ValueError(
            f"{type(block).__name__}: the attention processor returned {len(outputs)} outputs; "
            "expected 2 (image, text) or 3 (with IP-Adapter's)"
        )
    hidden_states = mlp_half(ops, hidden_states, attn_output, emb, block.norm2, block.ff)
    if ip_attn_output is not None:
        hidden_states = hidden_states + ip_attn_output
    encoder_hidden_states = mlp_half(
        ops, encoder_hidden_states, context_attn_output, c_emb, block.norm2_context,
        block.ff_context,
    )  # fmt: skip
    return clip_fp16(encoder_hidden_states), hidden_states


def single_block_forward(
    block: nn.Module,
    ops: Ops,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    joint_attention_kwargs: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``FluxSingleTransformerBlock.forward`` on ditops' ops (see
    :mod:`ditops.integrations.flux.family`)."""
    text_seq_len = encoder_hidden_states.shape[1]
    residual = torch.cat([encoder_hidden_states, hidden_states], dim=1)
    n, (_, _, gate) = ada_modulate(ops, block.norm, residual, temb, 3)
    mlp_hidden_states = block.act_mlp(block.proj_mlp(n))
    attn_output = block.attn(
        hidden_states=n, image_rotary_emb=image_rotary_emb, **(joint_attention_kwargs or {})
    )
    out = block.proj_out(torch.cat([attn_output, mlp_hidden_states], dim=2))
    hidden_states = clip_fp16(ops.residual(residual, out, gate.unsqueeze(1)))
    return hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]


class FusedFluxAttnProcessor(DenseProcessor):
    """diffusers' ``FluxAttnProcessor`` with the attention prologue on ditops'
    ``qk_norm_rope`` (see :mod:`ditops.integrations.flux.family`); everything else is FLUX's code
    path.

    The attention backend and the context-parallel config diffusers writes on a
    processor (``_attention_backend``, ``_parallel_config``) are those of the wrapped
    original, so ``set_attention_backend`` and ``enable_parallelism`` work before and
    after the patch, and survive ``unpatch``. A call without rotary tables, or with
    tables other than ``FluxPosEmbed``'s ``[L, D]``, runs the original processor.
    """

    wraps = ("diffusers.models.transformers.transformer_flux", "FluxAttnProcessor")

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Any:
        if (
            self.ops is None
            or float64_call(hidden_states)  # cast after the patch: FLUX's own code
            or image_rotary_emb is None
            or image_rotary_emb[0].dim() != 2
            or _prologue_bypass(attn).problem(attn) is not None
        ):
            # No ops, no rotation, tables other than FluxPosEmbed's [L, D], or q/k norms
            # hooked or replaced since the patch: FLUX's own code (it calls the norms).
            return self.original(
                attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb
            )
        from diffusers.models.transformers import transformer_flux as tf

        query, key, value, e_query, e_key, e_value = tf._get_qkv_projections(
            attn, hidden_states, encoder_hidden_states
        )
        D = attn.head_dim
        query, key, value = (t.unflatten(-1, (-1, D)) for t in (query, key, value))
        # apply_rotary_emb rotates in fp32 whatever the tables' dtype: so does the op
        # given fp32 tables (a no-op for FluxPosEmbed's, which are fp32).
        cos, sin = (t.to(query.device, torch.float32) for t in image_rotary_emb)
        qk = self.ops.qk
        if attn.added_kv_proj_dim is not None:
            e_query, e_key, e_value = (t.unflatten(-1, (-1, D)) for t in (e_query, e_key, e_value))
            T = e_query.shape[1]
            nq, nk = attn.norm_added_q, attn.norm_added_k
            t_q, t_k = qk(e_query, e_key, nq.weight, nk.weight, cos[:T], sin[:T], nq.eps)
            nq, nk = attn.norm_q, attn.norm_k
            i_q, i_k = qk(query, key, nq.weight, nk.weight, cos[T:], sin[T:], nq.eps)
            query = torch.cat([t_q, i_q], dim=1)
            key = torch.cat([t_k, i_k], dim=1)
            value = torch.cat([e_value, value], dim=1)
        else:
            nq, nk = attn.norm_q, attn.norm_k
            query, key = qk(query, key, nq.weight, nk.weight, cos, sin, nq.eps)
        hidden_states = tf.dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=attention_mask,
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )
        hidden_states = hidden_states.flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is None:
            return hidden_states
        encoder_hidden_states, hidden_states = hidden_states.split_with_sizes(
            [
                encoder_hidden_states.shape[1],
                hidden_states.shape[1] - encoder_hidden_states.shape[1],
            ],
            dim=1,
        )
        hidden_states = attn.to_out[0](hidden_states.contiguous())
        hidden_states = attn.to_out[1](hidden_states)
        encoder_hidden_states = attn.to_add_out(encoder_hidden_states.contiguous())
        return hidden_states, encoder_hidden_states
