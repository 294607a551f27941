"""The fused forward of a patched LTX-2 block (both streams' norms and residuals on
ditops' ops) and :class:`LTX2SelfAttnProcessor`, the video self-attention with the
prologue on ``qk_norm_rope`` (interleaved rotary) and optional block sparsity. The
arithmetic is written out in :mod:`ditops.integrations.ltx2.family`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ditops.integrations.ltx_video.forwards import LTXOps, LTXSelfAttnProcessor, whole_row_qk
from ditops.integrations.shared.guard import float64_call
from ditops.integrations.shared.video_sparse import warn_once

#: The norms of each stream (self-attention, text, audio/video cross-attention, ff).
VIDEO_NORMS = ("norm1", "norm2", "audio_to_video_norm", "norm3")
AUDIO_NORMS = ("audio_norm1", "audio_norm2", "video_to_audio_norm", "audio_norm3")
#: What the fused block computes without calling it: every norm of both streams.
BLOCK_BYPASSES = VIDEO_NORMS + AUDIO_NORMS


def _rms(ops: LTXOps, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return ops.rms(x, norm.weight, norm.eps, convention="diffusers")


def _modulate(n: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    return n * (1 + scale) + shift


def _rms_modulate(
    ops: LTXOps, norm: nn.Module, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor
) -> torch.Tensor:
    """``_modulate(_rms(x), scale, shift)`` on ``rms_norm_scale``: the same roundings."""
    return ops.rms_scale(x, 1 + scale, norm.eps, weight=norm.weight, shift=shift)  # type: ignore[no-any-return]


def _text_kv(
    block: nn.Module, table: torch.Tensor, temb: Any, text: torch.Tensor, like: torch.Tensor
) -> torch.Tensor:
    """The text modulated for the prompt's K/V: per timestep, or by the per-layer table."""
    if temb is not None:
        shift, scale = block.get_mod_params(table, temb, like.size(0))
    else:
        shift, scale = table[None, None].to(device=like.device, dtype=like.dtype).unbind(dim=2)
    return _modulate(text, scale, shift)


class _Stream:
    """One stream of the block (video or audio): its modules and modulation rows."""

    def __init__(self, block: nn.Module, audio: bool, x: torch.Tensor, temb: torch.Tensor):
        p = "audio_" if audio else ""
        self.norms = [getattr(block, n) for n in (AUDIO_NORMS if audio else VIDEO_NORMS)]
        self.attn1, self.attn2 = getattr(block, p + "attn1"), getattr(block, p + "attn2")
        self.ff = getattr(block, p + "ff")
        self.adaln = (
            getattr(block, p + "cross_attn_adaln") if audio else block.video_cross_attn_adaln
        )
        self.mods = block.get_mod_params(getattr(block, p + "scale_shift_table"), temb, x.size(0))
        self.x = x

    def self_attention(self, ops: LTXOps, rope: Any, mask: Any, perturbed: dict) -> None:
        shift, scale, gate = self.mods[:3]
        n = _rms_modulate(ops, self.norms[0], self.x, scale, shift)
        out = self.attn1(
            hidden_states=n,
            encoder_hidden_states=None,
            query_rotary_emb=rope,
            attention_mask=mask,
            **perturbed,
        )
        self.x = ops.residual(self.x, out, gate)

    def text_attention(self, ops: LTXOps, text: torch.Tensor, mask: Any) -> None:
        n = _rms(ops, self.norms[1], self.x)
        if self.adaln:  # LTX-2.3: the text query modulated and gated too
            n = _modulate(n, self.mods[7], self.mods[6])
        out = self.attn2(n, encoder_hidden_states=text, query_rotary_emb=None, attention_mask=mask)
        self.x = ops.residual(self.x, out, self.mods[8] if self.adaln else None)

    def feed_forward(self, ops: LTXOps) -> torch.Tensor:
        shift, scale, gate = self.mods[3:6]
        n = _rms_modulate(ops, self.norms[3], self.x, scale, shift)
        return ops.residual(self.x, self.ff(n), gate)


def block_forward(
    block: nn.Module,
    ops: LTXOps,
    hidden_states: torch.Tensor,
    audio_hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    audio_encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    temb_audio: torch.Tensor,
    temb_ca_scale_shift: torch.Tensor,
    temb_ca_audio_scale_shift: torch.Tensor,
    temb_ca_gate: torch.Tensor,
    temb_ca_audio_gate: torch.Tensor,
    temb_prompt: torch.Tensor | None = None,
    temb_prompt_audio: torch.Tensor | None = None,
    video_rotary_emb: Any = None,
    audio_rotary_emb: Any = None,
    ca_video_rotary_emb: Any = None,
    ca_audio_rotary_emb: Any = None,
    encoder_attention_mask: torch.Tensor | None = None,
    audio_encoder_attention_mask: torch.Tensor | None = None,
    self_attention_mask: torch.Tensor | None = None,
    audio_self_attention_mask: torch.Tensor | None = None,
    a2v_cross_attention_mask: torch.Tensor | None = None,
    v2a_cross_attention_mask: torch.Tensor | None = None,
    use_a2v_cross_attention: bool = True,
    use_v2a_cross_attention: bool = True,
    perturbation_mask: torch.Tensor | None = None,
    all_perturbed: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``LTX2VideoTransformerBlock.forward`` with both streams' norms and residuals on
    ditops' ops (see :mod:`ditops.integrations.ltx2.family`). Installed through
    ``install_guarded``."""
    v = _Stream(block, False, hidden_states, temb)
    a = _Stream(block, True, audio_hidden_states, temb_audio)
    perturbed = {}
    if block.perturbed_attn:
        perturbed = {"perturbation_mask": perturbation_mask, "all_perturbed": all_perturbed}
    v.self_attention(ops, video_rotary_emb, self_attention_mask, perturbed)
    a.self_attention(ops, audio_rotary_emb, audio_self_attention_mask, perturbed)
    text, audio_text = encoder_hidden_states, audio_encoder_hidden_states
    if block.cross_attn_adaln:
        text = _text_kv(block, block.prompt_scale_shift_table, temb_prompt, text, v.x)
        audio_text = _text_kv(
            block, block.audio_prompt_scale_shift_table, temb_prompt_audio, audio_text, a.x
        )
    v.text_attention(ops, text, encoder_attention_mask)
    a.text_attention(ops, audio_text, audio_encoder_attention_mask)
    if use_a2v_cross_attention or use_v2a_cross_attention:
        B = hidden_states.size(0)
        vn, an = _rms(ops, v.norms[2], v.x), _rms(ops, a.norms[2], a.x)
        v_table, a_table = (
            block.video_a2v_cross_attn_scale_shift_table,
            block.audio_a2v_cross_attn_scale_shift_table,
        )
        v_ca = [m.squeeze(2) for m in block.get_mod_params(v_table[:4, :], temb_ca_scale_shift, B)]
        a_ca = [
            m.squeeze(2) for m in block.get_mod_params(a_table[:4, :], temb_ca_audio_scale_shift, B)
        ]
        a2v_gate = block.get_mod_params(v_table[4:, :], temb_ca_gate, B)[0].squeeze(2)
        v2a_gate = block.get_mod_params(a_table[4:, :], temb_ca_audio_gate, B)[0].squeeze(2)
        if use_a2v_cross_attention:  # q: video, k/v: audio; rows (scale, shift) 0, 1
            out = block.audio_to_video_attn(
                _modulate(vn, v_ca[0], v_ca[1]),
                encoder_hidden_states=_modulate(an, a_ca[0], a_ca[1]),
                query_rotary_emb=ca_video_rotary_emb,
                key_rotary_emb=ca_audio_rotary_emb,
                attention_mask=a2v_cross_attention_mask,
            )
            v.x = ops.residual(v.x, out, a2v_gate)
        if use_v2a_cross_attention:  # q: audio, k/v: video; rows 2, 3
            out = block.video_to_audio_attn(
                _modulate(an, a_ca[2], a_ca[3]),
                encoder_hidden_states=_modulate(vn, v_ca[2], v_ca[3]),
                query_rotary_emb=ca_audio_rotary_emb,
                key_rotary_emb=ca_video_rotary_emb,
                attention_mask=v2a_cross_attention_mask,
            )
            a.x = ops.residual(a.x, out, v2a_gate)
    return v.feed_forward(ops), a.feed_forward(ops)


class LTX2SelfAttnProcessor(LTXSelfAttnProcessor):
    """diffusers' ``LTX2AudioVideoAttnProcessor`` on LTX-2's video self-attention
    (``attn1``): the prologue on ditops' ``qk_norm_rope`` when ``ops`` is given and the
    rotary is interleaved (``[B, S, H * D]`` tables), block-sparse attention on the sparse
    steps when ``sparse`` is; the per-head gates of gated attention as diffusers applies
    them.

    Everything else is the wrapped processor's code path: a call with keys of another
    sequence, key tables, no query tables, a float64 call, and a dense step without the
    fused prologue. A call with a self-attention mask (IC-LoRA's reference tokens) runs
    the original, dense, on sparse steps too (block-sparse attention takes no mask; ditops
    says so once). With split rotary tables (per head, ``[B, H, S, D / 2]``) the prologue
    is diffusers' (norms called as modules, ``apply_split_rotary_emb``).
    """

    #: The diffusers processor this class wraps: (module, class name).
    wraps = ("diffusers.models.transformers.transformer_ltx2", "LTX2AudioVideoAttnProcessor")
    #: diffusers 0.42 cannot run LTX-2 under context parallelism (its plan leaves the
    #: cross-modal rotary tables whole): sparse steps there are refused.
    context_parallel = False

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        query_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        key_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        args = (
            attn,
            hidden_states,
            encoder_hidden_states,
            attention_mask,
            query_rotary_emb,
            key_rotary_emb,
        )
        if (
            float64_call(hidden_states)
            or encoder_hidden_states is not None
            or key_rotary_emb is not None
            or query_rotary_emb is None
        ):
            return self.original(*args)
        own = self.own_attention()
        if attention_mask is not None:
            if own:
                warn_once(
                    "ditops: an LTX-2 video self-attention call with a mask (IC-LoRA) runs "
                    "dense attention with the mask on sparse steps too: block-sparse attention "
                    "takes no mask"
                )
            return self.original(*args)
        prologue = attn.rope_type == "interleaved" and self._fused_prologue(
            attn, hidden_states, query_rotary_emb
        )
        if not prologue and not own:
            return self.original(*args)
        from diffusers.models.transformers import transformer_ltx2 as t2

        gates = None
        if attn.to_gate_logits is not None:
            gates = attn.to_gate_logits(hidden_states)
        query = attn.to_q(hidden_states)
        key = attn.to_k(hidden_states)
        value = attn.to_v(hidden_states)
        if prologue:
            query, key = whole_row_qk(self.ops, attn, query, key, query_rotary_emb)
        else:
            rotate = (
                t2.apply_interleaved_rotary_emb
                if attn.rope_type == "interleaved"
                else t2.apply_split_rotary_emb
            )
            query = rotate(attn.norm_q(query), query_rotary_emb)
            key = rotate(attn.norm_k(key), query_rotary_emb)
        query, key, value = (t.unflatten(2, (attn.heads, -1)) for t in (query, key, value))
        out = self.attend(query, key, value)
        out = out.flatten(2, 3).to(query.dtype)
        if gates is not None:
            out = out.unflatten(2, (attn.heads, -1))
            out = (out * (2.0 * torch.sigmoid(gates)).unsqueeze(-1)).flatten(2, 3)
        out = attn.to_out[0](out)
        return attn.to_out[1](out)
