"""Patching diffusers' ``HunyuanVideoTransformer3DModel`` (HunyuanVideo T2V and I2V).

Its blocks are FLUX's adaLN-Zero chain in the model dtype, with the text tokens *last*
(diffusers 0.42):

* ``HunyuanVideoTransformerBlock`` (double-stream)::

      n, gate, shift_mlp, scale_mlp, gate_mlp = norm1(h, temb)   # LN(h) * (1 + s) + sh
      c_n, c_gate, ... = norm1_context(c, temb)
      a, c_a = attn(n, c_n, mask, rope)
      h = h + a * gate;  n = norm2(h) * (1 + scale_mlp) + shift_mlp
      h = h + gate_mlp * ff(n)             # and the same for the text stream c

* ``HunyuanVideoSingleTransformerBlock`` (single-stream over ``cat([video, text])``)::

      n, gate = norm(x, temb);  m = act(proj_mlp(n))
      a, c_a = attn(n[:, :-T], n[:, -T:], mask, rope)
      x = gate * proj_out(cat([cat([a, c_a]), m], dim=2)) + x

* ``norm_out`` (``AdaLayerNormContinuous``): ``LN(h) * (1 + scale) + shift``.

The patched blocks run the same expressions on
:func:`~ditops.ops.modulation_model_dtype.adaln_modulate`,
:func:`~ditops.ops.modulation_model_dtype.adaln_residual_modulate` and
:func:`~ditops.ops.modulation_model_dtype.adaln_residual` (``h + a * g`` and ``g * a + h``
are the same bits: products and sums commute), and the attention on
:class:`~ditops.integrations.hunyuan_video.attention.HunyuanVideoAttnProcessor` (the q/k
prologue on ``qk_norm_rope`` / ``rms_norm``; block-sparse video attention when asked).
In exact precision the patched model is bitwise the unpatched one.

The I2V ``token_replace`` blocks (two modulations split at the first frame) run the same
ops on the two row ranges (:mod:`~ditops.integrations.hunyuan_video.token_replace`). Left as
diffusers runs them: the token refiner (``context_embedder``: its ``nn.LayerNorm`` has
affine parameters, which no adaLN op means) and the embeddings.

This module declares the family (:data:`SPEC`; the fused forwards are in
:mod:`~ditops.integrations.hunyuan_video.forwards`). Before changing anything, the
skeleton's check compares the blocks, norms and processors against what it was written
for, and the source of every diffusers function whose arithmetic it reproduces against the
fingerprints of the versions it was checked with: a model that does not match is refused
whole, with the reasons.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from torch import nn

from ditops.integrations.hunyuan_video import token_replace
from ditops.integrations.hunyuan_video.attention import (
    HunyuanVideoAttnProcessor,
    attention_problems,
)
from ditops.integrations.hunyuan_video.forwards import (
    double_block_forward,
    single_block_forward,
)
from ditops.integrations.shared.adaln_zero import (
    DOUBLE_BYPASSES,
    SINGLE_BYPASSES,
    AdaLNOps,
    norm_out_forward,
    norm_out_problems,
    relied_on_norms,
    zero_norm_problem,
)
from ditops.integrations.shared.base import is_plain_layer_norm
from ditops.integrations.shared.family import Attention, Blocks, FamilySpec, Fused, Relied, Sparse
from ditops.integrations.shared.fingerprints import known, relied
from ditops.integrations.shared.guard import forward_wrapper_problem

#: ``HunyuanVideoTransformerBlock.forward`` (HunyuanVideo-1.5's block is the same code).
DOUBLE = known("HunyuanVideoTransformerBlock.forward")


def relied_on() -> Relied:
    """The diffusers functions besides the blocks and processors whose arithmetic the patch
    reproduces, with the fingerprints of the versions checked (HunyuanVideo-1.5 relies on
    the same)."""
    from diffusers.models import embeddings, normalization

    return {
        **relied_on_norms(),
        **relied(normalization, "RMSNorm.forward"),
        **relied(embeddings, "apply_rotary_emb"),
    }


def _wrapped(block: nn.Module, where: str) -> list[str]:
    found = forward_wrapper_problem(block, where)
    return [found] if found else []


def double_problems(block: nn.Module, where: str) -> list[str]:
    """A double-stream block the fused forward computes: adaLN-Zero over LayerNorms
    without affine, diffusers' q/k RMSNorms; else the model is refused."""
    found = [zero_norm_problem(block, name, single=False) for name in ("norm1", "norm1_context")]
    problems = [f"{where}.{f}" for f in found if f]
    for name in ("norm2", "norm2_context"):
        if not is_plain_layer_norm(getattr(block, name, None)):
            problems.append(f"{where}.{name} is not a LayerNorm without affine parameters")
    return problems + attention_problems(block, where, True) + _wrapped(block, where)


def _single_problems(block: nn.Module, where: str) -> list[str]:
    found = zero_norm_problem(block, "norm", single=True)
    problems = [f"{where}.{found}"] if found else []
    return problems + attention_problems(block, where, False) + _wrapped(block, where)


def _token_replace_problems(double: bool) -> Callable[[nn.Module, str], list[str]]:
    def problems(block: nn.Module, where: str) -> list[str]:
        found = token_replace.norm_problems(block, where, double)
        return found + attention_problems(block, where, double) + _wrapped(block, where)

    return problems


def _patch_size(model: nn.Module) -> tuple[int, ...]:
    config = model.config  # type: ignore[attr-defined]
    return (config.patch_size_t, config.patch_size, config.patch_size)


#: The double-stream kind, shared with HunyuanVideo-1.5.
DOUBLE_BLOCK = Fused(
    "HunyuanVideoTransformerBlock.forward",
    DOUBLE,
    double_block_forward,
    DOUBLE_BYPASSES,
    problems=double_problems,
    attention="attn",
)
#: The output norm, shared with HunyuanVideo-1.5.
NORM_OUT = Blocks(
    ("norm_out",),
    (
        Fused(
            "AdaLayerNormContinuous.forward",
            known("AdaLayerNormContinuous.forward"),
            norm_out_forward,
            ("norm",),
            problems=norm_out_problems,
            kind="output norm",
        ),
    ),
    required=True,
    norms_only=True,
)
#: diffusers gives HunyuanVideo no context-parallel plan: sparse steps under one refused.
SPARSE = Sparse(patch_size=_patch_size, count_steps=True, context_parallel=False)

SPEC = FamilySpec(
    name="hunyuan_video",
    model_classes=("HunyuanVideoTransformer3DModel",),
    summary="fused adaLN chain and attention prologue, optional block-sparse video self-attention",
    blocks=(
        Blocks(
            ("transformer_blocks",),
            (DOUBLE_BLOCK,
             Fused("HunyuanVideoTokenReplaceTransformerBlock.forward",
                   known("HunyuanVideoTokenReplaceTransformerBlock.forward"),
                   token_replace.token_replace_double_forward, DOUBLE_BYPASSES,
                   problems=_token_replace_problems(True), attention="attn")),
        ),
        Blocks(
            ("single_transformer_blocks",),
            (Fused("HunyuanVideoSingleTransformerBlock.forward",
                   known("HunyuanVideoSingleTransformerBlock.forward"), single_block_forward,
                   SINGLE_BYPASSES,
                   problems=_single_problems, attention="attn"),
             Fused("HunyuanVideoTokenReplaceSingleTransformerBlock.forward",
                   known("HunyuanVideoTokenReplaceSingleTransformerBlock.forward"),
                   token_replace.token_replace_single_forward, SINGLE_BYPASSES,
                   problems=_token_replace_problems(False), attention="attn")),
        ),
        NORM_OUT,
    ),
    ops=AdaLNOps.of,
    attention=Attention(
        {HunyuanVideoAttnProcessor.wraps: HunyuanVideoAttnProcessor},
        known("HunyuanVideoAttnProcessor2_0.__call__"),
    ),
    sparse=SPARSE,
    relied_on=lambda: {**relied_on(), **token_replace.relied_on()},
)  # fmt: skip

#: HunyuanVideo-Framepack (``HunyuanVideoFramepackTransformer3DModel``) is built of
#: HunyuanVideo's blocks and processor; the history and clean latents it puts before the
#: video tokens are attended densely on sparse steps (see ``attention``).
FRAMEPACK = replace(
    SPEC,
    name="hunyuan_video_framepack",
    model_classes=("HunyuanVideoFramepackTransformer3DModel",),
    summary=(
        "HunyuanVideo's (its blocks): fused adaLN chain and attention prologue, optional "
        "block-sparse video self-attention with the history latents dense"
    ),
)
