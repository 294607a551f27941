"""Patching diffusers' ``ChromaTransformer2DModel`` (Chroma1-HD and models built like it).

Chroma is FLUX with the modulation pruned: no block projects the conditioning; the
``distilled_guidance_layer`` (an approximator) computes every modulation once per
forward, ``pooled_temb`` ``[B, M, C]``, and the model hands each block its rows. Its
blocks, in the model dtype (diffusers 0.42), with ``LN`` a LayerNorm without affine:

* ``ChromaTransformerBlock`` (double-stream, ``temb`` ``[B, 12, C]``; the norms are
  ``ChromaAdaLayerNormZeroPruned``)::

      shift, scale, gate, shift_mlp, scale_mlp, gate_mlp = temb[:, :6].flatten(1, 2).chunk(6, 1)
      n = LN(h) * (1 + scale[:, None]) + shift[:, None]     # and c's from temb[:, 6:]
      mask = m[:, None, None, :] * m[:, None, :, None]       # if a [B, L] mask is given
      a, c_a = attn(n, c_n, rope, mask)                     # FLUX's attention
      then FLUX's double block after attention: h = h + gate * a;
      n = norm2(h) * (1 + scale_mlp) + shift_mlp; h = h + gate_mlp * ff(n) (+ IP-Adapter's);
      the same for c; fp16: c = c.clip(-65504, 65504)

* ``ChromaSingleTransformerBlock`` (over the ``[text, image]`` sequence the model
  concatenated; ``temb`` ``[B, 3, C]``, ``ChromaAdaLayerNormZeroSinglePruned``)::

      n = LN(h) * (1 + scale[:, None]) + shift[:, None];  m = act(proj_mlp(n))
      h = h + gate.unsqueeze(1) * proj_out(cat([attn(n, rope, mask), m]));  fp16: clip

* ``norm_out`` (``ChromaAdaLayerNormContinuousPruned``): ``shift, scale =
  chunk(temb.flatten(1, 2).to(x.dtype), 2)`` (shift first), ``LN(x) * (1 + scale)[:, None]
  + shift[:, None]``.

The patched model runs the same expressions on ditops' ops: the modulated norms on
:func:`~ditops.ops.modulation_model_dtype.adaln_modulate`, each gated residual followed by
``norm2`` on :func:`~ditops.ops.modulation_model_dtype.adaln_residual_modulate`, the last
residual of each stream on :func:`~ditops.ops.modulation_model_dtype.adaln_residual`,
FLUX's fp16 clip where Chroma has it. Attention is FLUX's ``FluxAttnProcessor``, wrapped
as in FLUX by :class:`~ditops.integrations.flux.forwards.FusedFluxAttnProcessor` (q/k
RMSNorm and rotary on ``qk_norm_rope``; the pair mask passed on to diffusers' attention
dispatch as FLUX's processor does). In exact precision the patched model is bitwise the
unpatched one.

Left as diffusers runs it: the approximator (``nn.RMSNorm`` and linear layers, once per
forward), the embeddings, attention processors of other classes (kept, blocks still
fused). A block or output norm whose norms are of another kind runs diffusers' forward.
Sparse attention is refused (image model).

This module declares the family (:data:`SPEC`); the fused forwards are in
:mod:`ditops.integrations.chroma.forwards`.
"""

from __future__ import annotations

from torch import nn

from ditops.integrations.chroma.forwards import (
    NORM_OUT_BYPASSES,
    double_block_forward,
    norm_out_forward,
    single_block_forward,
)
from ditops.integrations.flux.family import qk_norm_problems
from ditops.integrations.flux.forwards import FusedFluxAttnProcessor
from ditops.integrations.shared.adaln_zero import DOUBLE_BYPASSES, SINGLE_BYPASSES, AdaLNOps
from ditops.integrations.shared.base import is_plain_layer_norm
from ditops.integrations.shared.family import Attention, Blocks, FamilySpec, Fused
from ditops.integrations.shared.fingerprints import known, relied


def _pruned_problem(module: nn.Module, name: str, cls_name: str) -> str | None:
    """Why ``module.<name>`` is not Chroma's ``cls_name`` over a LayerNorm without
    affine (and without an embedding of its own), or None."""
    from diffusers.models.transformers import transformer_chroma as tc

    norm = getattr(module, name, None) if name else module
    if (
        type(norm) is not getattr(tc, cls_name)
        or getattr(norm, "emb", None) is not None
        or not is_plain_layer_norm(getattr(norm, "norm", None))
    ):
        return f"{name or 'it'} is not a {cls_name} over a LayerNorm without affine"
    return None


def _double_unfused(block: nn.Module, where: str) -> list[str]:
    """A double-stream block whose norms are not what the fused forward computes runs
    diffusers' forward."""
    found = [_pruned_problem(block, n, "ChromaAdaLayerNormZeroPruned")
             for n in ("norm1", "norm1_context")]  # fmt: skip
    for name in ("norm2", "norm2_context"):
        norm = getattr(block, name, None)
        if not is_plain_layer_norm(norm):
            found.append(f"{name} is a {type(norm).__name__}, not a LayerNorm without affine")
    return [f for f in found if f]


def _single_unfused(block: nn.Module, where: str) -> list[str]:
    return [f for f in [_pruned_problem(block, "norm", "ChromaAdaLayerNormZeroSinglePruned")] if f]


def _norm_out_unfused(norm: nn.Module, where: str) -> list[str]:
    return [f for f in [_pruned_problem(norm, "", "ChromaAdaLayerNormContinuousPruned")] if f]


SPEC = FamilySpec(
    name="chroma",
    model_classes=("ChromaTransformer2DModel",),
    summary="fused adaLN chain (modulations from the approximator) and attention prologue",
    blocks=(
        Blocks(
            ("transformer_blocks",),
            (Fused("ChromaTransformerBlock.forward", known("ChromaTransformerBlock.forward"),
                   double_block_forward, DOUBLE_BYPASSES, unfused=_double_unfused,
                   attention="attn", prologue=qk_norm_problems),),
        ),
        Blocks(
            ("single_transformer_blocks",),
            (Fused("ChromaSingleTransformerBlock.forward",
                   known("ChromaSingleTransformerBlock.forward"),
                   single_block_forward, SINGLE_BYPASSES, unfused=_single_unfused,
                   attention="attn", prologue=qk_norm_problems),),
        ),
        Blocks(
            ("norm_out",),
            (Fused("ChromaAdaLayerNormContinuousPruned.forward",
                   known("ChromaAdaLayerNormContinuousPruned.forward"), norm_out_forward,
                   NORM_OUT_BYPASSES,
                   unfused=_norm_out_unfused, kind="output norm"),),
            required=True,
        ),
    ),
    ops=AdaLNOps.of,
    attention=Attention(
        {FusedFluxAttnProcessor.wraps: FusedFluxAttnProcessor},
        known("FluxAttnProcessor.__call__"),
        keep_others=True,  # IP-Adapter's (or the user's) stay; the blocks are fused
    ),
    relied_on=lambda: {
        **relied(
            "diffusers.models.transformers.transformer_chroma",
            "ChromaAdaLayerNormZeroPruned.forward",
            "ChromaAdaLayerNormZeroSinglePruned.forward",
        ),
        **relied("diffusers.models.embeddings", "apply_rotary_emb"),
    },
)  # fmt: skip
