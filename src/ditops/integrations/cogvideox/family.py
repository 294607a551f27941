"""Patching diffusers' ``CogVideoXTransformer3DModel`` (CogVideoX 1.0 and 1.5).

What diffusers 0.42 computes, every tensor in the model dtype unless said. A
``CogVideoXBlock`` (text ``e`` of ``T`` tokens, video ``h``; ``temb`` the conditioning)::

    shift, scale, gate, e_shift, e_scale, e_gate = norm1.linear(silu(temb)).chunk(6, dim=1)
    n   = norm1.norm(h) * (1 + scale)[:, None] + shift[:, None]        # CogVideoXLayerNormZero
    e_n = norm1.norm(e) * (1 + e_scale)[:, None] + e_shift[:, None]     # the same LayerNorm
    a, e_a = attn1(n, e_n, rotary)
    h = h + gate[:, None] * a
    e = e + e_gate[:, None] * e_a
    (norm2: the same with its own six chunks) -> n, e_n
    f = ff(cat([e_n, n], dim=1))
    h = h + gate_ff[:, None] * f[:, T:]
    e = e + e_gate_ff[:, None] * f[:, :T]

``norm.norm`` is an ``nn.LayerNorm`` with affine weight and bias
(``norm_elementwise_affine=True``, every published checkpoint). The attention
(``CogVideoXAttnProcessor2_0``) projects ``x = cat([e, h])`` (text first), views q/k/v
as ``[B, H, N, D]``, norms q and k with ``norm_q``/``norm_k`` (``nn.LayerNorm`` over the
head dim, affine, eps 1e-6; every row), rotates the video rows in place
(``q[:, :, T:] = apply_rotary_emb(q[:, :, T:], rotary)``: interleaved pairs, in fp32,
rounded to the dtype; the same for k), runs ``F.scaled_dot_product_attention`` without a
mask, ``to_out`` and splits ``[text, video]``. The output norm ``norm_out``
(``AdaLayerNorm``, ``chunk_dim=1``) is ``norm(x) * (1 + scale) + shift`` with
``shift, scale = linear(silu(temb)).chunk(2, dim=1)``. CogVideoX 1.5 (``patch_size_t``)
runs the same blocks; only the patch embedding and the output's unpatchify differ.

What ditops runs (:mod:`~ditops.integrations.cogvideox.forwards`):

* gated residuals ``h + gate * a``: :func:`~ditops.ops.modulation_model_dtype.adaln_residual`
  (bitwise in every dtype);
* the modulated norms (``norm1``, ``norm2``, ``norm_out``), with the affine LayerNorm:
  in fp32 :func:`~ditops.ops.modulation_fp32.layer_norm_scale_shift` and the residual
  with the next norm :func:`~ditops.ops.modulation_fp32.scale_residual_layer_norm_scale_shift`
  (their meaning is diffusers' expression in fp32: bitwise). In bf16/fp16 no op matches:
  diffusers rounds the affine LayerNorm's output, ``1 + scale``, the product and the sum
  to the dtype, ``modulation_model_dtype`` takes no affine weight/bias and
  ``modulation_fp32`` rounds once; exact precision leaves that expression as diffusers
  runs it (the residual still fused), fast precision runs the fp32 ops (rounded once,
  within their fast contract). Norms without affine go on the model-dtype ops
  (``adaln_modulate``, ``adaln_residual_modulate``), bitwise in every dtype;
* the attention prologue: the rotary embedding of the video rows on
  :func:`~ditops.ops.qk_norm_rope.rotary_embedding` (bit for bit ``apply_rotary_emb`` with
  fp32 tables). The q/k norms stay the model's own ``nn.LayerNorm`` calls:
  ``qk_norm_rope`` and ``rms_norm`` are RMSNorms, not a LayerNorm with mean and bias.
  CogVideoX-2B has no rotary tables (sin-cos positions in the patch embedding): its
  dense calls run diffusers' processor, nothing of them fused;
* sparse steps (``attention=BlockSparseConfig(...)``): text queries dense over every key,
  video queries block-sparse over [text keys, video keys] with the text and the first
  latent frame's keys dense (:mod:`~ditops.integrations.shared.joint_sparse`); the patch
  size is ``(patch_size_t or 1, patch_size, patch_size)``. ``CogVideoXPipeline`` enters
  ``cache_context("cond_uncond")`` without a step index, guidance batched: the step is
  counted from the timesteps, each sample keeps its mask under its own branch. Under a
  context-parallel config sparse attention is refused (the processor calls SDPA itself).

In exact precision the patched model is bitwise the unpatched one. Before changing
anything the skeleton (:mod:`~ditops.integrations.shared.family`) checks the blocks,
norms and processors against the fingerprints of what this module reproduces and
refuses a model that differs, whole. A block whose norms are not diffusers' (a module of
the user's) runs diffusers' forward; other attention processors (diffusers'
``FusedCogVideoXAttnProcessor2_0``, the user's) are kept unless sparse attention is asked.
"""

from __future__ import annotations

from torch import nn

from ditops.integrations.cogvideox.forwards import (
    BLOCK_BYPASSES,
    NORM_OUT_BYPASSES,
    CogVideoXAttnProcessor,
    CogVideoXOps,
    block_forward,
    norm_out_forward,
)
from ditops.integrations.shared.family import Attention, Blocks, FamilySpec, Fused, Sparse
from ditops.integrations.shared.fingerprints import known, relied


def _layer_norm_problem(norm: object, name: str) -> str | None:
    if type(norm) is not nn.LayerNorm:
        return f"{name} is a {type(norm).__name__}, not an nn.LayerNorm"
    return None


def _block_unfused(block: nn.Module, where: str) -> list[str]:
    """A block whose norms are not diffusers' ``CogVideoXLayerNormZero`` over an
    ``nn.LayerNorm`` (a norm of the user's) runs diffusers' forward."""
    from diffusers.models.normalization import CogVideoXLayerNormZero

    found = []
    for name in ("norm1", "norm2"):
        norm = getattr(block, name, None)
        if type(norm) is not CogVideoXLayerNormZero:
            found.append(f"{name} is a {type(norm).__name__}, not CogVideoXLayerNormZero")
            continue
        found.append(_layer_norm_problem(norm.norm, f"{name}.norm"))
        if type(norm.silu) is not nn.SiLU:
            found.append(f"{name}.silu is a {type(norm.silu).__name__}, not nn.SiLU")
    return [f for f in found if f]


def _norm_out_problems(norm: nn.Module, where: str) -> list[str]:
    """The output norm the fused forward computes: an AdaLayerNorm over an nn.LayerNorm
    with ``chunk_dim=1`` and no timestep embedding of its own (CogVideoX's)."""
    problem = _layer_norm_problem(getattr(norm, "norm", None), f"{where}.norm")
    if problem is None and (getattr(norm, "emb", None) is not None or norm.chunk_dim != 1):
        problem = f"{where} is not an AdaLayerNorm with chunk_dim=1 and no timestep embedding"
    return [problem] if problem else []


def _patch_size(model: nn.Module) -> tuple[int, int, int] | None:
    config = getattr(model, "config", None)
    p = getattr(config, "patch_size", None)
    if not isinstance(p, int):
        return None
    return (getattr(config, "patch_size_t", None) or 1, p, p)


def _without_rotary(model: nn.Module) -> str | None:
    """CogVideoX-2B's layout (sin-cos positions, no rotary tables): the prologue would
    fuse nothing, so dense calls keep diffusers' processor."""
    if getattr(getattr(model, "config", None), "use_rotary_positional_embeddings", True):
        return None
    return "no rotary embedding: nothing to fuse in the prologue"


SPEC = FamilySpec(
    name="cogvideox",
    model_classes=("CogVideoXTransformer3DModel",),
    summary=(
        "fused gated residuals and modulated norms (affine: fp32, or fast precision), rotary "
        "of the video rows, optional block-sparse attention (1.0 and 1.5)"
    ),
    blocks=(
        Blocks(
            ("transformer_blocks",),
            (Fused("CogVideoXBlock.forward", known("CogVideoXBlock.forward"),
                   block_forward, BLOCK_BYPASSES, unfused=_block_unfused, attention="attn1"),),
            required=True,
        ),
        Blocks(
            ("norm_out",),
            (Fused("AdaLayerNorm.forward", known("AdaLayerNorm.forward"),
                   norm_out_forward, NORM_OUT_BYPASSES, unfused=_norm_out_problems,
                   kind="output norm"),),
            norms_only=True,
        ),
    ),
    ops=CogVideoXOps.of,
    attention=Attention(
        {CogVideoXAttnProcessor.wraps: CogVideoXAttnProcessor},
        known("CogVideoXAttnProcessor2_0.__call__"),
        keep_others=True,  # diffusers' fused-QKV processor (or the user's) stays
    ),
    sparse=Sparse(_patch_size, context_parallel=False),  # its processor calls SDPA itself
    plain_model=_without_rotary,
    # the patch embedding: the token order the sparse path's dense first frame relies on
    relied_on=lambda: {
        **relied("diffusers.models.normalization", "CogVideoXLayerNormZero.forward",
                 "AdaLayerNorm.forward"),
        **relied("diffusers.models.embeddings", "apply_rotary_emb", "CogVideoXPatchEmbed.forward"),
    },
)  # fmt: skip
