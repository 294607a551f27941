"""The fused forwards of a patched FLUX model: the double- and single-stream blocks and
on ditops' adaLN ops (``adaln_zero.AdaLNOps``, one bundle per patched model), and
:class:`FusedFluxAttnProcessor`, FLUX's attention with the prologue on ``qk_norm_rope``.
The arithmetic they reproduce is written out in :mod:`ditops.integrations.flux.family`, which
checks a model and installs these (through
:func:`~ditops.integrations.shared.guard.install_guarded`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ditops.integrations.shared.adaln_zero import AdaLNOps, ada_modulate, mlp_half
from ditops.integrations.shared.guard import Bypass, float64_call
from ditops.integrations.shared.processors import DenseProcessor

#: FLUX clips fp16 activations to the largest finite fp16 after some residual adds.
FP16_MAX = 65504.0


def prologue_bypass(attn: nn.Module) -> Bypass:
    """The q/k norms a fused prologue computes without calling them (FLUX.1 and FLUX.2)."""
    names = ["norm_q", "norm_k"]
    if getattr(attn, "added_kv_proj_dim", None) is not None:
        names += ["norm_added_q", "norm_added_k"]
    return Bypass(tuple((name, nn.RMSNorm) for name in names))


def clip_fp16(h: torch.Tensor) -> torch.Tensor:
    """FLUX's own guard (FLUX.1, FLUX.2 and Chroma), in its own place (after the residual
    adds it names): fp16 activations clipped to the largest finite fp16."""
    if h.dtype == torch.float16:
        return h.clip(-FP16_MAX, FP16_MAX)
    return h


def fused_tables(
    image_rotary_emb: Any, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The rotary tables as the fused prologue takes them (fp32 on ``device``), or None
    where it would not compute what ``apply_rotary_emb`` does: no tables, tables other than
    the ``[L, D]`` of FLUX's position embeddings, or fp64 tables (diffusers then rotates in
    fp64). ``apply_rotary_emb`` rotates in fp32 given fp32, bf16 or fp16 tables: so does
    the op given them widened to fp32 (exact; a no-op for the fp32 tables FLUX makes)."""
    if image_rotary_emb is None or image_rotary_emb[0].dim() != 2:
        return None
    if image_rotary_emb[0].dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    cos, sin = (t.to(device, torch.float32) for t in image_rotary_emb)
    return cos, sin


def norm_rope(
    ops: AdaLNOps,
    attn: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``norm_q``/``norm_k`` then the rotary embedding, of ``[B, L, H, D]`` q and k, on
    the fused ``qk`` op."""
    nq, nk = attn.norm_q, attn.norm_k
    return ops.qk(query, key, nq.weight, nk.weight, cos, sin, nq.eps)  # type: ignore[no-any-return]


def _norm_rope_joint(
    ops: AdaLNOps,
    attn: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    e_query: torch.Tensor,
    e_key: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The double-stream prologue: the text tokens' q/k (``norm_added_q``/``norm_added_k``,
    the first rows of the tables) and the image tokens' (``norm_q``/``norm_k``, the rest),
    each on the fused ``qk`` op, concatenated ``[text, image]`` as FLUX does (the rotation
    is per row: rotating the parts is rotating the whole)."""
    T = e_query.shape[1]
    nq, nk = attn.norm_added_q, attn.norm_added_k
    t_q, t_k = ops.qk(e_query, e_key, nq.weight, nk.weight, cos[:T], sin[:T], nq.eps)
    i_q, i_k = norm_rope(ops, attn, query, key, cos[T:], sin[T:])
    return torch.cat([t_q, i_q], dim=1), torch.cat([t_k, i_k], dim=1)


def fused_qkv(
    ops: AdaLNOps, attn: nn.Module, projections: tuple, tables: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v ``[B, L, H, D]`` of FLUX's and FLUX.2's joint or single-stream attention,
    from diffusers' ``_get_qkv_projections`` (six tensors): the prologue on the fused
    ``qk`` op, the text rows (``add_*_proj``, if the module has them) first."""
    query, key, value, e_query, e_key, e_value = projections
    D = attn.head_dim
    query, key, value = (t.unflatten(-1, (-1, D)) for t in (query, key, value))
    if attn.added_kv_proj_dim is None:
        query, key = norm_rope(ops, attn, query, key, *tables)
        return query, key, value
    e_query, e_key, e_value = (t.unflatten(-1, (-1, D)) for t in (e_query, e_key, e_value))
    query, key = _norm_rope_joint(ops, attn, query, key, e_query, e_key, *tables)
    return query, key, torch.cat([e_value, value], dim=1)


def double_block_forward(
    block: nn.Module,
    ops: AdaLNOps,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    joint_attention_kwargs: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``FluxTransformerBlock.forward`` on ditops' ops (see :mod:`ditops.integrations.flux.family`).

    Installed through :func:`~ditops.integrations.shared.guard.install_guarded`: it runs only
    while nothing is attached to the modules it bypasses
    (:data:`~ditops.integrations.shared.adaln_zero.DOUBLE_BYPASSES`).
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
    ops: AdaLNOps,
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
        ops,
        encoder_hidden_states,
        context_attn_output,
        c_emb,
        block.norm2_context,
        block.ff_context,
    )
    return clip_fp16(encoder_hidden_states), hidden_states


def single_block_forward(
    block: nn.Module,
    ops: AdaLNOps,
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
    tables other than ``FluxPosEmbed``'s ``[L, D]`` (or in fp64), runs the original processor.
    """

    wraps = ("diffusers.models.transformers.transformer_flux", "FluxAttnProcessor")
    arithmetic_label = "FluxAttnProcessor.__call__"

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Any:
        tables = fused_tables(image_rotary_emb, hidden_states.device)
        if (
            self.ops is None
            or float64_call(hidden_states)  # cast after the patch: FLUX's own code
            or tables is None
            or prologue_bypass(attn).problem(attn) is not None
        ):
            # No ops, no rotation, tables the op would not rotate as FLUX does, or q/k
            # norms hooked or replaced since the patch: FLUX's own code (it calls the norms).
            return self.original(
                attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb
            )
        from diffusers.models.transformers import transformer_flux as tf

        projections = tf._get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        query, key, value = fused_qkv(self.ops, attn, projections, tables)
        hidden_states = tf.dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=attention_mask,
            backend=self._attention_backend,
            **self._parallel_kwargs(),
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
        if self.arithmetic == "0.36":
            # diffusers 0.35-0.36 hand the output projections the split views as they are
            return attn.to_out[1](attn.to_out[0](hidden_states)), attn.to_add_out(
                encoder_hidden_states
            )
        hidden_states = attn.to_out[0](hidden_states.contiguous())
        hidden_states = attn.to_out[1](hidden_states)
        encoder_hidden_states = attn.to_add_out(encoder_hidden_states.contiguous())
        return hidden_states, encoder_hidden_states
