"""The fused forwards of a patched FLUX.2 model: the double-stream and the parallel
single-stream blocks on ditops' adaLN ops (``adaln_zero.AdaLNOps``, one bundle per
patched model), and FLUX.2's two attention processors with the q/k prologue on
``qk_norm_rope``. The arithmetic they reproduce is written out in
:mod:`ditops.integrations.flux2.family`, which checks a model and installs these.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ditops.integrations.flux.forwards import (
    clip_fp16,
    fused_qkv,
    fused_tables,
    norm_rope,
    prologue_bypass,
)
from ditops.integrations.shared.adaln_zero import AdaLNOps
from ditops.integrations.shared.guard import float64_call
from ditops.integrations.shared.processors import DenseProcessor

#: What each fused forward computes without calling it (see :class:`~.guard.Bypass`).
DOUBLE_BYPASSES = ("norm1", "norm1_context", "norm2", "norm2_context")
SINGLE_BYPASSES = ("norm",)

_MODULE = "diffusers.models.transformers.transformer_flux2"


def _split(mod: torch.Tensor | tuple, sets: int) -> tuple[tuple[torch.Tensor, ...], ...]:
    # diffusers' own split (called, not reproduced): [B, 1, D] views, or [B, L, D] where
    # the KV-cache pipeline blends per-token modulations; the ops take both.
    if isinstance(mod, tuple):  # diffusers 0.36: the model split it (the same chunks)
        return mod if sets > 1 else (mod,)
    from diffusers.models.transformers.transformer_flux2 import Flux2Modulation

    return Flux2Modulation.split(mod, sets)  # type: ignore[no-any-return]


def _stream(
    ops: AdaLNOps,
    h: torch.Tensor,
    attn_output: torch.Tensor,
    mods: tuple,
    norm2: nn.Module,
    ff: Any,
) -> torch.Tensor:
    """One stream after attention: ``h + gate * a``, ``norm2`` modulated by the MLP's
    pair, ``h + gate_mlp * ff(n)`` (``mods``: the stream's two shift/scale/gate sets)."""
    (_, _, gate), (shift_mlp, scale_mlp, gate_mlp) = mods
    n, h = ops.residual_modulate(h, attn_output, gate, scale_mlp, shift_mlp, norm2.eps)
    return ops.residual(h, ff(n), gate_mlp)  # type: ignore[no-any-return]


def double_block_forward(
    block: nn.Module,
    ops: AdaLNOps,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb_mod_img: torch.Tensor | None = None,
    temb_mod_txt: torch.Tensor | None = None,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    joint_attention_kwargs: dict[str, Any] | None = None,
    *,
    temb_mod_params_img: tuple | None = None,
    temb_mod_params_txt: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``Flux2TransformerBlock.forward`` on ditops' ops (see
    :mod:`ditops.integrations.flux2.family`); runs only while nothing is attached to the
    norms it bypasses (:data:`DOUBLE_BYPASSES`). diffusers 0.36's model passes the
    modulations already split, as ``temb_mod_params_img``/``_txt``."""
    img = _split(temb_mod_params_img if temb_mod_img is None else temb_mod_img, 2)
    txt = _split(temb_mod_params_txt if temb_mod_txt is None else temb_mod_txt, 2)
    (shift, scale, _), _ = img
    (c_shift, c_scale, _), _ = txt
    n = ops.modulate(hidden_states, scale, shift, block.norm1.eps)
    c_n = ops.modulate(encoder_hidden_states, c_scale, c_shift, block.norm1_context.eps)
    attn_output, context_attn_output = block.attn(
        hidden_states=n,
        encoder_hidden_states=c_n,
        image_rotary_emb=image_rotary_emb,
        **(joint_attention_kwargs or {}),
    )
    hidden_states = _stream(ops, hidden_states, attn_output, img, block.norm2, block.ff)
    encoder_hidden_states = _stream(
        ops,
        encoder_hidden_states,
        context_attn_output,
        txt,
        block.norm2_context,
        block.ff_context,
    )
    return clip_fp16(encoder_hidden_states), hidden_states


def single_block_forward(
    block: nn.Module,
    ops: AdaLNOps,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor | None,
    temb_mod: torch.Tensor | None = None,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    joint_attention_kwargs: dict[str, Any] | None = None,
    split_hidden_states: bool = False,
    text_seq_len: int | None = None,
    *,
    temb_mod_params: tuple | None = None,
) -> Any:
    """``Flux2SingleTransformerBlock.forward`` on ditops' ops (see
    :mod:`ditops.integrations.flux2.family`; diffusers 0.36: ``temb_mod_params``, split)."""
    if encoder_hidden_states is not None:
        text_seq_len = encoder_hidden_states.shape[1]
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
    shift, scale, gate = _split(temb_mod_params if temb_mod is None else temb_mod, 1)[0]
    n = ops.modulate(hidden_states, scale, shift, block.norm.eps)
    attn_output = block.attn(
        hidden_states=n, image_rotary_emb=image_rotary_emb, **(joint_attention_kwargs or {})
    )
    hidden_states = clip_fp16(ops.residual(hidden_states, attn_output, gate))
    if split_hidden_states:
        return hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]
    return hidden_states


class _Flux2Processor(DenseProcessor):
    """What both FLUX.2 processors share: the tables of a fused call, the attention."""

    wraps: tuple[str, str]

    def _tables(
        self, attn: nn.Module, hidden_states: torch.Tensor, image_rotary_emb: Any
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The tables for the fused prologue, or None where the original's code runs: no
        ops, a float64 call, tables the op would not rotate as FLUX.2 does, q/k norms
        hooked or replaced since the patch (the original calls them)."""
        if self.ops is None or float64_call(hidden_states):
            return None
        if prologue_bypass(attn).problem(attn) is not None:
            return None
        return fused_tables(image_rotary_emb, hidden_states.device)

    def _attend(self, query: Any, key: Any, value: Any, attention_mask: Any) -> torch.Tensor:
        from diffusers.models.transformers import transformer_flux2 as tf

        out = tf.dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=attention_mask,
            backend=self._attention_backend,
            **self._parallel_kwargs(),
        )
        return out.flatten(2, 3).to(query.dtype)  # type: ignore[no-any-return]


class FusedFlux2AttnProcessor(_Flux2Processor):
    """diffusers' ``Flux2AttnProcessor`` (the double-stream blocks' joint attention) with
    the q/k prologue on ditops' ``qk_norm_rope``; everything else is FLUX.2's code path.
    The backend and context-parallel config are those of the wrapped original."""

    #: The diffusers processor this class wraps: (module, class name).
    wraps = (_MODULE, "Flux2AttnProcessor")

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: Any = None,
    ) -> Any:
        tables = self._tables(attn, hidden_states, image_rotary_emb)
        if tables is None:
            return self.original(
                attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb
            )
        from diffusers.models.transformers import transformer_flux2 as tf

        projections = tf._get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        query, key, value = fused_qkv(self.ops, attn, projections, tables)
        hidden_states = self._attend(query, key, value, attention_mask)
        if encoder_hidden_states is not None:
            T = encoder_hidden_states.shape[1]
            encoder_hidden_states, hidden_states = hidden_states.split_with_sizes(
                [T, hidden_states.shape[1] - T], dim=1
            )
            encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        if encoder_hidden_states is not None:
            return hidden_states, encoder_hidden_states
        return hidden_states


class FusedFlux2ParallelSelfAttnProcessor(_Flux2Processor):
    """diffusers' ``Flux2ParallelSelfAttnProcessor`` (the single-stream blocks: q, k, v
    and the MLP's input from one projection, attention and the SwiGLU MLP out through one)
    with the q/k prologue on ditops' ``qk_norm_rope``; everything else is FLUX.2's code
    path. The backend and context-parallel config are those of the wrapped original."""

    #: The diffusers processor this class wraps: (module, class name).
    wraps = (_MODULE, "Flux2ParallelSelfAttnProcessor")

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: Any = None,
    ) -> Any:
        tables = self._tables(attn, hidden_states, image_rotary_emb)
        if tables is None:
            return self.original(attn, hidden_states, attention_mask, image_rotary_emb)
        hidden_states = attn.to_qkv_mlp_proj(hidden_states)
        # diffusers' split by the global QKV:MLP ratio (the same with column sharding)
        qkv_dim = 3 * attn.inner_dim
        mlp_dim = attn.mlp_hidden_dim * attn.mlp_mult_factor
        width = hidden_states.shape[-1]
        local_qkv = width * qkv_dim // (qkv_dim + mlp_dim)
        qkv, mlp_hidden_states = torch.split(hidden_states, [local_qkv, width - local_qkv], dim=-1)
        D = attn.head_dim
        query, key, value = (t.unflatten(-1, (-1, D)) for t in qkv.chunk(3, dim=-1))
        query, key = norm_rope(self.ops, attn, query, key, *tables)
        hidden_states = self._attend(query, key, value, attention_mask)
        mlp_hidden_states = attn.mlp_act_fn(mlp_hidden_states)
        return attn.to_out(torch.cat([hidden_states, mlp_hidden_states], dim=-1))
