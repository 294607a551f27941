"""Patching diffusers' ``LTXVideoTransformer3DModel`` (LTX-Video 0.9.x).

Each ``LTXVideoTransformerBlock`` computes, every tensor in the model dtype (diffusers
0.42; ``temb`` ``[B, T, 6 * C]``, ``T`` 1, or one per token when the pipeline gives a
timestep per token)::

    ada = table[None, None] + temb.reshape(B, T, 6, C)    # table: scale_shift_table [6, C]
    s_msa, c_msa, g_msa, s_mlp, c_mlp, g_mlp = ada.unbind(2)
    n = rms(h) * (1 + c_msa) + s_msa          # norm1: diffusers' RMSNorm, no weight:
                                              #   (h * rsqrt(mean(h.float()^2) + eps)).to(dtype)
    h = h + attn1(n, rope) * g_msa            # self-attention
    h = h + attn2(h, text, mask)              # cross-attention, no norm, no gate
    n = rms(h) * (1 + c_mlp) + s_mlp          # norm2
    h = h + ff(n) * g_mlp

and ``attn1`` (``LTXVideoAttnProcessor``) computes ``q = rope(norm_q(to_q(n)))``, the same
for ``k`` with ``norm_k`` (``torch.nn.RMSNorm`` over all heads, ``H * D``), where LTX's
rotary (``apply_rotary_emb``) rotates interleaved pairs over all ``H * D`` channels at
once with ``[B, S, H * D]`` fp32 tables: ``(x.float() * cos + rot(x).float() * sin)
.to(dtype)``; then q, k, v split into heads and ``dispatch_attention_fn``.

The patched block runs the same expressions on ditops' ops where one reproduces them
bitwise: both norms on :func:`~ditops.ops.qk_norm_rope.rms_norm` (``convention=
"diffusers"``: diffusers' RMSNorm arithmetic), the two gated residuals on
:func:`~ditops.ops.modulation_model_dtype.adaln_residual` (``h + g * a``: the same
product and sum). The modulations ``* (1 + c) + s`` stay eager: ditops' modulated norms
(``adaln_modulate``, ``layer_norm_scale_shift``) normalise with a LayerNorm, and LTX's norm
is an RMSNorm; no op takes an RMSNorm and a modulation (a fused ``rms_modulate`` would be
a new op). The cross-attention's plain residual add stays eager too (nothing to fuse).
The self-attention prologue runs on :func:`~ditops.ops.qk_norm_rope.qk_norm_rope` with the
whole ``H * D`` row as one head (the norm spans all heads, and so do the tables), in
torch's RMSNorm arithmetic and interleaved pairs: bitwise what LTX computes. The
cross-attention (``attn2``: normed q/k, no rotary), the model's ``norm_out`` (a LayerNorm
modulated in the model's own forward) and the projections run as diffusers runs them.
In exact precision the patched model is bitwise the unpatched one.

With ``attention=BlockSparseConfig(...)`` the self-attention runs ditops'
:class:`~ditops.layers.sparse_attention.BlockSparseAttention` on the sparse steps
(:mod:`ditops.integrations.shared.video_sparse`): LTX's pipelines pack the latents in
``(frame, height, width)`` order before the call and pass the grid as ``num_frames``,
``height``, ``width`` (the rotary's grid), which the patch records to keep the first
frame's blocks dense (with ``config.patch_size_t`` / ``patch_size``); a call that gives
``video_coords`` instead (``LTXConditionPipeline``) has its grid read from them (eager
calls), and one whose tokens make no grid (conditioning tokens appended) runs its sparse
steps without the first frame's blocks, and says so once. ``LTXPipeline`` enters
``cache_context("cond_uncond")`` without a step index, both guidance branches in one
batch: the step is counted from the timestep.

Before changing anything the skeleton's check (:mod:`~ditops.integrations.shared.family`)
compares the block forwards, the processors and every diffusers function the fused code
reproduces against the fingerprints of the versions it was written for; a model that does
not match is refused whole. A block whose norms are not diffusers' RMSNorm without bias
runs diffusers' forward; a self-attention processor of another class is kept (the blocks
are still fused) unless sparse attention is asked.
"""

from __future__ import annotations

from torch import nn

from ditops.integrations.ltx_video.forwards import (
    BLOCK_BYPASSES,
    LTXOps,
    LTXSelfAttnProcessor,
    block_forward,
)
from ditops.integrations.shared.family import Attention, Blocks, FamilySpec, Fused, Sparse
from ditops.integrations.shared.fingerprints import known, relied
from ditops.integrations.shared.video_sparse import grid_recorder


def norm_problems(block: nn.Module, names: tuple[str, ...]) -> list[str]:
    """Why ``block``'s norms are not diffusers' RMSNorm without bias (what the fused
    forward computes on the ``rms_norm`` op), if they are not."""
    from diffusers.models.normalization import RMSNorm

    found = []
    for name in names:
        norm = getattr(block, name, None)
        if type(norm) is not RMSNorm or norm.bias is not None:
            found.append(f"{name} is a {type(norm).__name__}, not diffusers' RMSNorm without bias")
    return found


def _block_unfused(block: nn.Module, where: str) -> list[str]:
    return norm_problems(block, BLOCK_BYPASSES)


def prologue_problems(attn: nn.Module, where: str) -> list[str]:
    """The q/k norms of the fused prologue: torch RMSNorms over all heads (``H * D``), of
    one eps and one weight dtype (the op takes one of each per call)."""
    q, k = getattr(attn, "norm_q", None), getattr(attn, "norm_k", None)
    if type(q) is not nn.RMSNorm or type(k) is not nn.RMSNorm:
        return [f"{where}.norm_q/norm_k are not torch.nn.RMSNorm"]
    problems = []
    width = (attn.inner_dim,)
    if tuple(q.normalized_shape) != width or tuple(k.normalized_shape) != width:
        problems.append(f"{where}.norm_q/norm_k do not normalise over all heads ({width[0]})")
    if q.eps != k.eps:
        problems.append(f"{where}.norm_q and norm_k have different eps ({q.eps}, {k.eps})")
    qw, kw = q.weight, k.weight
    if (qw is None) != (kw is None) or (qw is not None and qw.dtype != kw.dtype):
        problems.append(f"{where}.norm_q and norm_k differ in weight (one None, or dtypes)")
    return problems


def patch_size(model: nn.Module) -> tuple[int, int, int] | None:
    """``(patch_size_t, patch_size, patch_size)`` from the model's config."""
    config = getattr(model, "config", None)
    t, s = getattr(config, "patch_size_t", None), getattr(config, "patch_size", None)
    if not isinstance(t, int) or not isinstance(s, int):
        return None
    return (t, s, s)


SPEC = FamilySpec(
    name="ltx_video",
    model_classes=("LTXVideoTransformer3DModel",),
    summary="fused RMSNorm / gated-residual chain and self-attention prologue, optional "
    "block-sparse video self-attention",
    blocks=(
        Blocks(
            ("transformer_blocks",),
            (Fused("LTXVideoTransformerBlock.forward", known("LTXVideoTransformerBlock.forward"),
                   block_forward, BLOCK_BYPASSES, unfused=_block_unfused, attention="attn1",
                   prologue=prologue_problems),),
            required=True,
        ),
    ),
    ops=LTXOps.of,
    attention=Attention(
        {LTXSelfAttnProcessor.wraps: LTXSelfAttnProcessor},
        known("LTXVideoAttnProcessor.__call__"),
        keep_others=True,  # the user's processor stays (refused with sparse attention)
    ),
    # The grid and the step (counted from the timestep, by name) from the call's arguments.
    sparse=Sparse(patch_size, count_steps=False, recorder=grid_recorder),
    relied_on=lambda: {
        **relied("diffusers.models.normalization", "RMSNorm.forward"),
        **relied("diffusers.models.transformers.transformer_ltx", "apply_rotary_emb",
                 label="transformer_ltx.{}"),
        **relied("diffusers.models.transformers.transformer_ltx", "LTXAttention.forward"),
    },
)  # fmt: skip
