"""Patching diffusers' ``MochiTransformer3DModel`` (Mochi 1).

Mochi's blocks (diffusers 0.42, ``transformer_mochi.py``) modulate with RMSNorms computed
in fp32, rounding to the model dtype once per expression. With ``rms(x)`` diffusers'
``RMSNorm(0, eps, False)`` of ``x.float()`` (``x * rsqrt(mean(x^2) + eps)``, fp32):

* ``MochiRMSNormZero`` (``norm1``, ``norm1_context``): ``scale, gate, scale_mlp,
  gate_mlp = linear(silu(temb)).chunk(4)``, ``n = (rms(h) * (1 + scale[:, None].float()))
  .to(dtype)``;
* ``MochiModulatedRMSNorm`` (``norm2`` to ``norm4``): ``mod(x, s) = (rms(x) * s).to(dtype)``;
* ``MochiTransformerBlock``, for the video stream ``h`` and the text stream ``c`` alike::

      a, c_a = attn1(n, c_n, rope, mask)
      h = h + mod(a, tanh(gate)[:, None]);  n = mod(h, 1 + scale_mlp[:, None].float())
      h = h + mod(ff(n), tanh(gate_mlp)[:, None])

  The last block (``context_pre_only``) norms the text with ``MochiLayerNormContinuous``
  (``mod(c, 1 + linear_1(silu(temb).to(dtype))[:, None].float())``) and leaves it there.
* ``MochiAttnProcessor2_0``: ``q, k, v`` of the video tokens, ``MochiRMSNorm`` per head
  (``(x * rsqrt(mean(x.float()^2) + eps) * weight).to(dtype)``, one rounding), then
  Mochi's rotation with per-head tables ``[L, H, D/2]`` (pairs interleaved, in fp32,
  rounded once: ``x1 cos - x2 sin``, ``x1 sin + x2 cos``); the text tokens' q/k normed
  alike, not rotated; then per sample, SDPA over ``[video, the text tokens the mask
  keeps]`` (text last, padded text left out), the padded rows' output zero.
* ``norm_out`` (``AdaLayerNormContinuous``): ``LN(h) * (1 + scale) + shift``, model dtype.

What the patched model runs on ditops' ops, bitwise the unpatched model: every ``rms``
above on :func:`~ditops.ops.qk_norm_rope.rms_norm` (``convention="diffusers"``, no
weight: the same code); the video q/k norm and rotation on
:func:`~ditops.ops.qk_norm_rope.qk_norm_rope` (the heads as its batch, so that the
per-head tables are per-"batch" ``[H, L, 1, D/2]`` tables; torch's ``F.rms_norm``, the
op's ``"torch"`` convention, is MochiRMSNorm's arithmetic on torch 2.13: checked, see
``torch_rms_norm_is_known``); the text q/k norms on ``rms_norm``; ``norm_out`` on
:func:`~ditops.ops.modulation_model_dtype.adaln_modulate`.

Left eager, as Mochi writes them: the modulation products and their casts (``rms(x) *
s`` then ``.to(dtype)``: no op multiplies an fp32 norm by a per-sample fp32 scale and
rounds once: the model-dtype ops round the norm first, the fp32 chain is a LayerNorm),
the ``tanh`` gates and the residual adds (a model-dtype add of an already rounded
term: ``adaln_residual`` would take the fp32 product unrounded), the linears, the
feed-forwards and attention itself (per-sample SDPA, as the original).

Sparse steps (``attention=BlockSparseConfig(...)``) split Mochi's attention by queries
(:func:`~ditops.integrations.shared.joint_sparse.joint_sparse_attention`, text last):
text queries dense over every kept key, as Mochi; video queries block-sparse over ``[the
sample's kept text keys, video keys]``, the text and the first latent frame's keys in
the leading dense blocks (counted in the density, so the density asked is the density
run). Padded text is left out exactly as Mochi leaves it out (never a key; its rows'
output zero). Dense steps are bitwise the unpatched model (exact precision); with
``norms=False`` sparse steps run Mochi's own q/k norms and rotation. A model whose
forwards, processors or reproduced diffusers functions differ from the versions checked
is refused whole (fingerprints); a block with a norm of another kind runs diffusers'
forward; a processor of another class is kept (with sparse attention: refused).
"""

from __future__ import annotations

from torch import nn

from ditops.integrations.mochi.forwards import (
    BYPASSES,
    QK_NORMS,
    FusedMochiAttnProcessor,
    block_forward,
)
from ditops.integrations.shared.adaln_zero import AdaLNOps, norm_out_blocks
from ditops.integrations.shared.family import Attention, Blocks, FamilySpec, Fused, Sparse
from ditops.integrations.shared.fingerprints import known, relied


def _plain_rms(norm: object) -> bool:
    """diffusers' ``RMSNorm`` itself without weight or bias (``RMSNorm(0, eps, False)``)."""
    from diffusers.models.normalization import RMSNorm

    return type(norm) is RMSNorm and norm.weight is None and getattr(norm, "bias", None) is None


def _unfused(block: nn.Module, where: str) -> list[str]:
    """A block whose norms are not the ones the fused forward computes (a norm of the
    user's) runs diffusers' forward: the reasons."""
    from diffusers.models.transformers import transformer_mochi as tm

    zero, mod, cont = tm.MochiRMSNormZero, tm.MochiModulatedRMSNorm, tm.MochiLayerNormContinuous
    expected = {"norm1": zero, "norm2": mod, "norm3": mod, "norm4": mod}
    if block.context_pre_only:
        expected["norm1_context"] = cont
    else:
        expected.update(norm1_context=zero, norm2_context=mod, norm3_context=mod,
                        norm4_context=mod)  # fmt: skip
    found = []
    for name, cls in expected.items():
        norm = getattr(block, name, None)
        inner = getattr(norm, "norm", None)
        if cls is cont:
            inner = getattr(inner, "norm", None) if type(inner) is mod else None
        if type(norm) is not cls or not _plain_rms(inner):
            found.append(f"{name} is a {type(norm).__name__}, not a {cls.__name__} over "
                         "an RMSNorm without weight")  # fmt: skip
    return found


def _prologue(attn: nn.Module, where: str) -> list[str]:
    """The q/k norms the fused prologue computes: MochiRMSNorms over the head dim with a
    weight, q's and k's of one eps and weight dtype; torch's ``F.rms_norm`` with their
    arithmetic."""
    from diffusers.models.normalization import MochiRMSNorm

    from ditops.ops.qk_norm_rope_args import torch_rms_norm_is_known

    problems = []
    if not torch_rms_norm_is_known():
        problems.append(f"{where}: this torch's F.rms_norm does not compute MochiRMSNorm's "
                        "arithmetic (one rounding after the weight; torch 2.13 does)")  # fmt: skip
    head_dim = attn.inner_dim // attn.heads
    for name in QK_NORMS:
        norm = getattr(attn, name, None)
        if type(norm) is not MochiRMSNorm or norm.weight is None:
            problems.append(f"{where}.{name} is not a MochiRMSNorm with a weight")
        elif tuple(norm.dim) != (head_dim,):
            problems.append(f"{where}.{name} does not normalise over the head dim")
    if not problems:
        q, k = attn.norm_q, attn.norm_k
        if q.eps != k.eps or q.weight.dtype != k.weight.dtype:
            problems.append(f"{where}.norm_q and norm_k differ in eps or weight dtype")
    return problems


def _patch_size(model: nn.Module) -> tuple[int, int, int] | None:
    """Mochi patches each latent frame alone: ``(1, p, p)``."""
    p = getattr(getattr(model, "config", None), "patch_size", None)
    return (1, p, p) if isinstance(p, int) else None


SPEC = FamilySpec(
    name="mochi",
    model_classes=("MochiTransformer3DModel",),
    summary="fused RMSNorms and attention prologue, optional block-sparse video self-attention",
    blocks=(
        Blocks(
            ("transformer_blocks",),
            (Fused("MochiTransformerBlock.forward", known("MochiTransformerBlock.forward"),
                   block_forward, BYPASSES, unfused=_unfused, attention="attn1",
                   prologue=_prologue),),
            required=True,
        ),
        norm_out_blocks(),
    ),
    ops=AdaLNOps.of,
    attention=Attention(
        {FusedMochiAttnProcessor.wraps: FusedMochiAttnProcessor},
        known("MochiAttnProcessor2_0.__call__"),
        keep_others=True,  # a processor of the user's stays; the blocks are fused
    ),
    sparse=Sparse(_patch_size),
    relied_on=lambda: {
        **relied(
            "diffusers.models.transformers.transformer_mochi",
            "MochiRMSNormZero.forward",
            "MochiModulatedRMSNorm.forward",
            "MochiLayerNormContinuous.forward",
        ),
        **relied("diffusers.models.normalization", "RMSNorm.forward", "MochiRMSNorm.forward"),
    },
)  # fmt: skip
