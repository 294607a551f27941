"""The fused forward of a patched LTX-2 block (its video stream on ditops' ops, its audio
stream as diffusers computes it) and :class:`LTX2SelfAttnProcessor`, the video
self-attention with the prologue on ``qk_norm_rope`` (interleaved rotary) and optional
block sparsity. The arithmetic is written out in :mod:`ditops.integrations.ltx2.family`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ditops.integrations.ltx_video.forwards import LTXSelfAttnProcessor, whole_row_qk
from ditops.integrations.shared.guard import float64_call
from ditops.integrations.shared.ops import Ops
from ditops.integrations.shared.video_sparse import warn_once

#: What the fused block computes without calling it: the video stream's norms.
BLOCK_BYPASSES = ("norm1", "norm2", "audio_to_video_norm", "norm3")


def _rms(ops: Ops, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return ops.rms(x, norm.weight, norm.eps, convention="diffusers")


def _modulate(n: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    return n * (1 + scale) + shift


def _text_kv_mods(block: nn.Module, table: torch.Tensor, temb: Any, like: torch.Tensor, B: int):
    # the prompt's K/V modulation: per timestep, or the static per-layer table
    if temb is not None:
        return block.get_mod_params(table, temb, B)
    return table[None, None].to(device=like.device, dtype=like.dtype).unbind(dim=2)


def block_forward(
    block: nn.Module,
    ops: Ops,
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
    """``LTX2VideoTransformerBlock.forward``: the video stream's norms and gated residuals on
    ditops' ops, the audio stream's expressions as diffusers writes them (see
    :mod:`ditops.integrations.ltx2.family`). Installed through ``install_guarded``."""
    h, ah, B = hidden_states, audio_hidden_states, hidden_states.size(0)
    mods = block.get_mod_params
    v = mods(block.scale_shift_table, temb, B)
    a = mods(block.audio_scale_shift_table, temb_audio, B)
    perturbed = {}
    if block.perturbed_attn:
        perturbed = {"perturbation_mask": perturbation_mask, "all_perturbed": all_perturbed}

    # 1. self-attention: video on the ops, audio as diffusers
    n = _modulate(_rms(ops, block.norm1, h), v[1], v[0])
    out = block.attn1(hidden_states=n, encoder_hidden_states=None,
                      query_rotary_emb=video_rotary_emb, attention_mask=self_attention_mask,
                      **perturbed)  # fmt: skip
    h = ops.residual(h, out, v[2])
    n = _modulate(block.audio_norm1(ah), a[1], a[0])
    out = block.audio_attn1(hidden_states=n, encoder_hidden_states=None,
                            query_rotary_emb=audio_rotary_emb,
                            attention_mask=audio_self_attention_mask, **perturbed)  # fmt: skip
    ah = ah + out * a[2]

    # 2. cross-attention to the text
    text, audio_text = encoder_hidden_states, audio_encoder_hidden_states
    if block.cross_attn_adaln:
        shift_kv, scale_kv = _text_kv_mods(block, block.prompt_scale_shift_table, temb_prompt, h, B)
        a_shift_kv, a_scale_kv = _text_kv_mods(
            block, block.audio_prompt_scale_shift_table, temb_prompt_audio, ah, B
        )
        text = _modulate(text, scale_kv, shift_kv)
        audio_text = _modulate(audio_text, a_scale_kv, a_shift_kv)
    n = _rms(ops, block.norm2, h)
    if block.video_cross_attn_adaln:
        n = _modulate(n, v[7], v[6])
    out = block.attn2(n, encoder_hidden_states=text, query_rotary_emb=None,
                      attention_mask=encoder_attention_mask)  # fmt: skip
    h = ops.residual(h, out, v[8] if block.video_cross_attn_adaln else None)
    n = block.audio_norm2(ah)
    if block.audio_cross_attn_adaln:
        n = _modulate(n, a[7], a[6])
    out = block.audio_attn2(n, encoder_hidden_states=audio_text, query_rotary_emb=None,
                            attention_mask=audio_encoder_attention_mask)  # fmt: skip
    if block.audio_cross_attn_adaln:
        out = out * a[8]
    ah = ah + out

    # 3. audio-to-video and video-to-audio cross-attention
    if use_a2v_cross_attention or use_v2a_cross_attention:
        vn = _rms(ops, block.audio_to_video_norm, h)
        an = block.video_to_audio_norm(ah)
        v_table, a_table = (block.video_a2v_cross_attn_scale_shift_table,
                            block.audio_a2v_cross_attn_scale_shift_table)  # fmt: skip
        v_ca = mods(v_table[:4, :], temb_ca_scale_shift, B)
        a2v_gate = mods(v_table[4:, :], temb_ca_gate, B)[0].squeeze(2)
        a_ca = mods(a_table[:4, :], temb_ca_audio_scale_shift, B)
        v2a_gate = mods(a_table[4:, :], temb_ca_audio_gate, B)[0].squeeze(2)
        if use_a2v_cross_attention:
            q = _modulate(vn, v_ca[0].squeeze(2), v_ca[1].squeeze(2))
            kv = _modulate(an, a_ca[0].squeeze(2), a_ca[1].squeeze(2))
            out = block.audio_to_video_attn(q, encoder_hidden_states=kv,
                                            query_rotary_emb=ca_video_rotary_emb,
                                            key_rotary_emb=ca_audio_rotary_emb,
                                            attention_mask=a2v_cross_attention_mask)  # fmt: skip
            h = ops.residual(h, out, a2v_gate)
        if use_v2a_cross_attention:
            kv = _modulate(vn, v_ca[2].squeeze(2), v_ca[3].squeeze(2))
            q = _modulate(an, a_ca[2].squeeze(2), a_ca[3].squeeze(2))
            out = block.video_to_audio_attn(q, encoder_hidden_states=kv,
                                            query_rotary_emb=ca_audio_rotary_emb,
                                            key_rotary_emb=ca_video_rotary_emb,
                                            attention_mask=v2a_cross_attention_mask)  # fmt: skip
            ah = ah + v2a_gate * out

    # 4. feed-forward
    n = _modulate(_rms(ops, block.norm3, h), v[4], v[3])
    h = ops.residual(h, block.ff(n), v[5])
    n = _modulate(block.audio_norm3(ah), a[4], a[3])
    ah = ah + block.audio_ff(n) * a[5]
    return h, ah


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

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        query_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        key_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        args = (attn, hidden_states, encoder_hidden_states, attention_mask, query_rotary_emb,
                key_rotary_emb)  # fmt: skip
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
            rotate = (t2.apply_interleaved_rotary_emb if attn.rope_type == "interleaved"
                      else t2.apply_split_rotary_emb)  # fmt: skip
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
