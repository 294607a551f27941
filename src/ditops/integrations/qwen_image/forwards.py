"""The fused forwards of a patched Qwen-Image model: the double-stream block on ditops'
adaLN ops (``adaln_zero.AdaLNOps``, one bundle per patched model) and
:class:`FusedQwenImageAttnProcessor`, Qwen-Image's joint attention with the prologue on
``qk_norm_rope``. The arithmetic they reproduce is written out in
:mod:`ditops.integrations.qwen_image.family`, which checks a model and installs these.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ditops.integrations.shared.adaln_zero import AdaLNOps
from ditops.integrations.shared.complex_rope import ComplexRopeProcessor
from ditops.integrations.shared.guard import Bypass

#: Qwen-Image clips fp16 activations of both streams to the largest finite fp16.
FP16_MAX = 65504.0

#: What the fused block forward computes without calling it (see :class:`~.guard.Bypass`).
BLOCK_BYPASSES = ("img_norm1", "img_norm2", "txt_norm1", "txt_norm2")
#: The q/k norms the fused prologue computes without calling them.
QK_NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")

Mods = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _mods(params: torch.Tensor, index: torch.Tensor | None) -> Mods:
    """``QwenImageTransformerBlock._modulate``'s (shift, scale, gate), the same operations:
    ``[B, 1, D]`` each, or, with ``modulate_index`` (``zero_cond_t``), ``[B, L, D]`` picked
    per token from the two halves of the batch of ``params``."""
    shift, scale, gate = params.chunk(3, dim=-1)
    if index is None:
        return shift.unsqueeze(1), scale.unsqueeze(1), gate.unsqueeze(1)
    half = shift.size(0) // 2
    first = index.unsqueeze(-1) == 0
    return tuple(  # type: ignore[return-value]
        torch.where(first, t[:half].unsqueeze(1), t[half:].unsqueeze(1))
        for t in (shift, scale, gate)
    )


def _clip_fp16(h: torch.Tensor) -> torch.Tensor:
    if h.dtype == torch.float16:
        return h.clip(-FP16_MAX, FP16_MAX)
    return h


def _stream_rest(
    ops: AdaLNOps,
    h: torch.Tensor,
    attn_out: torch.Tensor,
    gate1: torch.Tensor,
    mod2: Mods,
    norm2: nn.Module,
    mlp: nn.Module,
) -> torch.Tensor:
    """``h + gate1 * attn``, ``norm2`` modulated by ``mod2``, ``h + gate2 * mlp(n)``."""
    shift2, scale2, gate2 = mod2
    n, h = ops.residual_modulate(h, attn_out, gate1, scale2, shift2, norm2.eps)
    return ops.residual(h, mlp(n), gate2)


def block_forward(
    block: nn.Module,
    ops: AdaLNOps,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    encoder_hidden_states_mask: torch.Tensor | None,
    temb: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    joint_attention_kwargs: dict[str, Any] | None = None,
    modulate_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``QwenImageTransformerBlock.forward`` on ditops' ops (see
    :mod:`ditops.integrations.qwen_image.family`).

    Installed through :func:`~ditops.integrations.shared.guard.install_guarded`: it runs only
    while nothing is attached to the norms it bypasses (:data:`BLOCK_BYPASSES`).
    """
    img_params = block.img_mod(temb)
    if getattr(block, "zero_cond_t", False):  # (diffusers 0.35-0.36 have no zero_cond_t)
        temb = torch.chunk(temb, 2, dim=0)[0]
    txt_params = block.txt_mod(temb)
    img_mod1, img_mod2 = img_params.chunk(2, dim=-1)
    txt_mod1, txt_mod2 = txt_params.chunk(2, dim=-1)
    img_shift1, img_scale1, img_gate1 = _mods(img_mod1, modulate_index)
    txt_shift1, txt_scale1, txt_gate1 = _mods(txt_mod1, None)
    img_n = ops.modulate(hidden_states, img_scale1, img_shift1, block.img_norm1.eps)
    txt_n = ops.modulate(encoder_hidden_states, txt_scale1, txt_shift1, block.txt_norm1.eps)
    img_attn, txt_attn = block.attn(
        hidden_states=img_n,
        encoder_hidden_states=txt_n,
        encoder_hidden_states_mask=encoder_hidden_states_mask,
        image_rotary_emb=image_rotary_emb,
        **(joint_attention_kwargs or {}),
    )
    hidden_states = _stream_rest(
        ops,
        hidden_states,
        img_attn,
        img_gate1,
        _mods(img_mod2, modulate_index),
        block.img_norm2,
        block.img_mlp,
    )
    encoder_hidden_states = _stream_rest(
        ops,
        encoder_hidden_states,
        txt_attn,
        txt_gate1,
        _mods(txt_mod2, None),
        block.txt_norm2,
        block.txt_mlp,
    )
    return _clip_fp16(encoder_hidden_states), _clip_fp16(hidden_states)


def qk_bypass() -> Bypass:
    """The q/k norms as the fused prologue finds them: diffusers' RMSNorms, no hooks."""
    from diffusers.models.normalization import RMSNorm

    return Bypass(tuple((name, RMSNorm) for name in QK_NORMS))


def _projections(attn: nn.Module, text: bool) -> tuple[nn.Module, nn.Module, nn.Module]:
    if text:
        return attn.add_q_proj, attn.add_k_proj, attn.add_v_proj
    return attn.to_q, attn.to_k, attn.to_v


def _heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    return x.unflatten(-1, (-1, head_dim))


class FusedQwenImageAttnProcessor(ComplexRopeProcessor):
    """diffusers' ``QwenDoubleStreamAttnProcessor2_0`` with the attention prologue (the
    RMSNorms of q and k per head, then the complex rotation) on ditops' ``qk_norm_rope``;
    everything else is Qwen-Image's code path (see :mod:`ditops.integrations.qwen_image.family`).

    The attention backend and the context-parallel config are those of the wrapped
    original. A call it was not written for runs the original processor: no ops, no
    rotary tables or tables other than ``QwenEmbedRope``'s complex ``[L, D/2]``, q/k norms
    hooked or replaced since the patch, or exact precision off the CPU (there the complex
    product may round differently from the op's ``x * cos + rotate(x) * sin``).
    """

    wraps = (
        "diffusers.models.transformers.transformer_qwenimage",
        "QwenDoubleStreamAttnProcessor2_0",
    )
    #: Three arithmetics (see ``fingerprint_table``): ``"0.42"`` (0.39 on) builds the joint
    #: mask from ``encoder_hidden_states_mask`` and refuses an ``attention_mask``;
    #: ``"0.38"`` (0.37-0.38: the model builds the joint mask) and ``"0.36"`` (0.35-0.36: no
    #: text mask at all) attend with ``attention_mask`` as given and ignore the text mask;
    #: ``"0.36"`` also hands the output projections the split views as they are.
    arithmetic_label = "QwenDoubleStreamAttnProcessor2_0.__call__"

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_hidden_states_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Any:
        rotary = image_rotary_emb if isinstance(image_rotary_emb, tuple) else ()
        tables = [self.tables(hidden_states, f, 2) for f in rotary]
        mask_as_given = self.arithmetic in ("0.36", "0.38")
        if (
            len(tables) != 2
            or None in tables
            or encoder_hidden_states is None  # (the original raises diffusers' errors)
            or (attention_mask is not None and not mask_as_given)
            or qk_bypass().problem(attn) is not None
        ):
            return self.original(
                attn,
                hidden_states,
                encoder_hidden_states,
                encoder_hidden_states_mask,
                attention_mask,
                image_rotary_emb,
            )
        if encoder_hidden_states_mask is not None and not mask_as_given:
            image_mask = torch.ones(
                (hidden_states.shape[0], hidden_states.shape[1]),
                dtype=torch.bool,
                device=hidden_states.device,
            )
            attention_mask = torch.cat([encoder_hidden_states_mask, image_mask], dim=1)
            attention_mask = attention_mask[:, None, None, :]
        seq_txt = encoder_hidden_states.shape[1]
        D = attn.inner_dim // attn.heads
        img, txt = hidden_states, encoder_hidden_states
        img_q, img_k, img_v = (_heads(p(img), D) for p in _projections(attn, False))
        txt_q, txt_k, txt_v = (_heads(p(txt), D) for p in _projections(attn, True))
        (img_cos, img_sin), (txt_cos, txt_sin) = tables  # type: ignore[misc]
        qk = self.ops.qk  # type: ignore[union-attr]
        nq, nk = attn.norm_q, attn.norm_k
        img_q, img_k = qk(
            img_q, img_k, nq.weight, nk.weight, img_cos, img_sin, nq.eps, convention="diffusers"
        )
        nq, nk = attn.norm_added_q, attn.norm_added_k
        txt_q, txt_k = qk(
            txt_q, txt_k, nq.weight, nk.weight, txt_cos, txt_sin, nq.eps, convention="diffusers"
        )
        query = torch.cat([txt_q, img_q], dim=1)
        out = self._dispatch_dense(
            query,
            torch.cat([txt_k, img_k], dim=1),
            torch.cat([txt_v, img_v], dim=1),
            attention_mask,
        )
        out = out.flatten(2, 3).to(query.dtype)
        img_out, txt_out = out[:, seq_txt:, :], out[:, :seq_txt, :]
        if self.arithmetic != "0.36":  # 0.35-0.36 project the split views as they are
            img_out, txt_out = img_out.contiguous(), txt_out.contiguous()
        img_out = attn.to_out[0](img_out)
        if len(attn.to_out) > 1:
            img_out = attn.to_out[1](img_out)
        return img_out, attn.to_add_out(txt_out)
