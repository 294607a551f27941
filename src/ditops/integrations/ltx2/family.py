"""Patching diffusers' ``LTX2VideoTransformer3DModel`` (LTX-2: video and audio).

Each ``LTX2VideoTransformerBlock`` runs a video stream ``h`` and an audio stream ``a``
side by side, every tensor in the model dtype (diffusers 0.42). With ``m(t, T) =
T[None, None] + t.reshape(B, -1, len(T), C)`` unbound into rows (``get_mod_params``), ``v
= m(temb, scale_shift_table)`` (six rows, nine with ``cross_attn_mod``: shift, scale,
gate of self-attention; of the feed-forward; of the text query) and ``rms`` diffusers'
RMSNorm without weight, the video stream is::

    h = h + attn1(rms(h) * (1 + v.scale) + v.shift, rope) * v.gate      # self-attention
    n = rms(h)                     (* (1 + v.scale_q) + v.shift_q with cross_attn_mod)
    h = h + attn2(n, text')        (* v.gate_q with cross_attn_mod)      # text
    n = rms(h)                                                           # audio_to_video_norm
    h = h + g_a2v * a2v_attn(n * (1 + s) + t, audio keys)                # audio-to-video
    h = h + ff(rms(h) * (1 + v.scale_mlp) + v.shift_mlp) * v.gate_mlp    # feed-forward

and the audio stream the same expressions with its own norms, tables and attentions
(``audio_attn1``, ``audio_attn2``, video-to-audio ``a = a + g_v2a * v2a_attn(...)``,
``audio_ff``); the video keys of the video-to-audio attention are ``n`` modulated by their
own pair. The self-attention processor (``LTX2AudioVideoAttnProcessor``) computes q and k
as LTX-Video's (``norm_q``/``norm_k``: ``torch.nn.RMSNorm`` over all heads), then the
rotary: ``interleaved`` (``apply_interleaved_rotary_emb``, LTX-Video's, ``[B, S, H * D]``
fp32 tables) or ``split`` (per head halves with per-head ``[B, H, S, D / 2]`` tables,
computed with ``addcmul_``), attention, and with gated attention ``out * 2 sigmoid(
to_gate_logits(x))`` per head.

The patched block runs both streams on ditops' ops where one reproduces them bitwise:
each stream's modulated norms (video ``norm1``, ``norm3``; audio ``audio_norm1``,
``audio_norm3``: ``rms(x) * (1 + s) + t``, each step rounded as eager) on
:func:`~ditops.ops.rms_norm_scale.rms_norm_scale`, its plain ones (``norm2``,
``audio_to_video_norm``; ``audio_norm2``, ``video_to_audio_norm``) on
:func:`~ditops.ops.qk_norm_rope.rms_norm` (diffusers' convention) and its four residuals
(self-attention, text, cross-modal, feed-forward) on
:func:`~ditops.ops.modulation_model_dtype.adaln_residual`; the cross-modal modulations of
the normed rows and ``1 + s`` stay eager. The video
self-attention's prologue runs on :func:`~ditops.ops.qk_norm_rope.qk_norm_rope` with the
``H * D`` row as one head when the rotary is interleaved. With ``split`` rotary (the
LTX-2 checkpoints' config) the prologue is diffusers' (the report counts it apart): the
op takes one table for all heads where split's differ per head, and
``apply_split_rotary_emb``'s ``addcmul_`` rounds otherwise than the op's meaning in fp32
and fp16. The audio self-attention (its prologue too: a second processor per block, on
few tokens), the text and audio/video cross-attentions, the output norms and projections
run as diffusers runs them. In exact precision the patched model is bitwise the unpatched one.

With ``attention=BlockSparseConfig(...)`` the video self-attention runs ditops'
block-sparse attention on the sparse steps, as LTX-Video's
(:mod:`ditops.integrations.shared.video_sparse`: the grid from ``num_frames``, ``height``,
``width``, which ``LTX2Pipeline`` passes with its ``video_coords``; tokens in ``(frame,
height, width)`` order; steps counted from the timestep in each of the pipeline's
``cache_context`` branches, ``cond_uncond``, ``uncond_stg``, ``uncond_modality``). The
audio self-attention stays dense. Models whose processors are of another class
(``perturbed_attn=True``: ``LTX2PerturbedAttnProcessor``, spatio-temporal guidance) keep
them, the blocks fused; sparse attention refuses them. Sparse attention under diffusers'
context parallelism is refused (diffusers 0.42 cannot run LTX-2 under it: its plan splits
the video tokens but not the audio-to-video rotary tables).
"""

from __future__ import annotations

from torch import nn

from ditops.integrations.ltx2.forwards import BLOCK_BYPASSES, LTX2SelfAttnProcessor, block_forward
from ditops.integrations.ltx_video.family import norm_problems, patch_size, prologue_problems
from ditops.integrations.ltx_video.forwards import LTXOps
from ditops.integrations.shared.family import Attention, Blocks, FamilySpec, Fused, Relied, Sparse
from ditops.integrations.shared.fingerprints import known
from ditops.integrations.shared.video_sparse import grid_recorder, split_rotary


def _relied_on() -> Relied:
    """The diffusers functions besides the block and the processor whose arithmetic the
    patch reproduces, with the fingerprints of the versions checked."""
    from diffusers.models import normalization
    from diffusers.models.transformers import transformer_ltx2 as t2

    block = t2.LTX2VideoTransformerBlock
    # (0.37's block has no get_mod_params: its forward, refused, says why; none to check)
    mods = getattr(block, "get_mod_params", None)
    return {
        "RMSNorm.forward": (normalization.RMSNorm.forward, known("RMSNorm.forward")),
        **({} if mods is None else {"LTX2VideoTransformerBlock.get_mod_params": (
            mods, known("LTX2VideoTransformerBlock.get_mod_params"))}),
        "transformer_ltx2.apply_interleaved_rotary_emb": (
            t2.apply_interleaved_rotary_emb, known("transformer_ltx2.apply_interleaved_rotary_emb")
        ),
        "transformer_ltx2.apply_split_rotary_emb": (
            t2.apply_split_rotary_emb, known("transformer_ltx2.apply_split_rotary_emb")
        ),
        "LTX2Attention.forward": (t2.LTX2Attention.forward, known("LTX2Attention.forward")),
    }  # fmt: skip


def _block_unfused(block: nn.Module, where: str) -> list[str]:
    return norm_problems(block, BLOCK_BYPASSES)


SPEC = FamilySpec(
    name="ltx2",
    model_classes=("LTX2VideoTransformer3DModel",),
    summary="fused RMSNorm / gated-residual chain of both streams and video self-attention "
    "prologue, optional block-sparse video self-attention (audio attention dense)",
    blocks=(
        Blocks(
            ("transformer_blocks",),
            (Fused("LTX2VideoTransformerBlock.forward", known("LTX2VideoTransformerBlock.forward"),
                   block_forward, BLOCK_BYPASSES, unfused=_block_unfused, attention="attn1",
                   prologue=prologue_problems),),
            required=True,
        ),
    ),
    ops=LTXOps.of,
    attention=Attention(
        {LTX2SelfAttnProcessor.wraps: LTX2SelfAttnProcessor},
        known("LTX2AudioVideoAttnProcessor.__call__"),
        keep_others=True,  # STG's perturbed processor (or the user's) stays; refused if sparse
        as_diffusers=split_rotary,
    ),
    # The grid and the step (counted from the timestep, by name) from the call's arguments.
    # Not under context parallelism: diffusers 0.42 itself fails there (its plan splits the
    # video tokens but not the audio-to-video rotary tables).
    sparse=Sparse(
        patch_size, count_steps=False, recorder=grid_recorder, context_parallel=False
    ),
    relied_on=_relied_on,
)  # fmt: skip
