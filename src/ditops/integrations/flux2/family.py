"""Patching diffusers' ``Flux2Transformer2DModel`` (FLUX.2 and models built like it).

FLUX.2 (diffusers 0.42, ``transformer_flux2.py``) computes the modulation once per
forward, shared by every block of a kind: ``Flux2Modulation`` is ``linear(silu(temb))``
(no bias), one for the double-stream image stream, one for their text stream (two
shift/scale/gate sets each) and one for the single-stream blocks (one set); each block
takes the raw projection and cuts it with ``Flux2Modulation.split`` (``[B, 6D]`` ->
``[B, 1, D]`` chunks; the KV-cache pipeline passes per-token ``[B, L, 6D]`` blends).
Every tensor is in the model dtype, each eager operation rounding to it; the norms are
``nn.LayerNorm`` without affine:

* ``Flux2TransformerBlock`` (double-stream: image ``h`` and text ``c``, joint attention)::

      n = (1 + scale) * norm1(h) + shift;  c_n = (1 + c_scale) * norm1_context(c) + c_shift
      a, c_a = attn(n, c_n, rope)
      h = h + gate * a;  n = norm2(h) * (1 + scale_mlp) + shift_mlp
      h = h + gate_mlp * ff(n)                     # ff: linear_out(SwiGLU(linear_in(n)))
      c = c + c_gate * c_a;  c_n = norm2_context(c) * (1 + c_scale_mlp) + c_shift_mlp
      c = c + c_gate_mlp * ff_context(c_n);  fp16: c = c.clip(-65504, 65504)

* ``Flux2SingleTransformerBlock`` (parallel: over ``cat([text, image])``)::

      n = (1 + scale) * norm(h) + shift
      h = h + gate * attn(n, rope);  fp16: h = h.clip(-65504, 65504)

  where the attention module holds the MLP too (``Flux2ParallelSelfAttnProcessor``):
  ``q, k, v, m = split(to_qkv_mlp_proj(n))``, attention as below,
  ``to_out(cat([attention, SwiGLU(m)]))``.

* The attention prologue (both processors): ``q = norm_q(q)``, ``k = norm_k(k)``
  (``torch.nn.RMSNorm`` over the head dim); in the double-stream blocks the text tokens'
  ``norm_added_q``/``norm_added_k``, then ``cat([text, image])``; then
  ``apply_rotary_emb(x, (cos, sin), sequence_dim=1)`` with interleaved pairs,
  ``(x.float() * cos + rotated.float() * sin).to(x.dtype)`` with ``Flux2PosEmbed``'s fp32
  ``[L, D]`` tables (text rows first).

* The output norm ``norm_out`` (``AdaLayerNormContinuous``, no bias):
  ``LN(h) * (1 + scale) + shift``, ``scale, shift`` from ``linear(silu(temb).to(h.dtype))``.

The patched model runs those expressions on ditops' ops in the same arithmetic (a product
is commutative bit for bit, so ``(1 + scale) * LN(h)`` is ``LN(h) * (1 + scale)``): each
modulated norm on :func:`~ditops.ops.modulation_model_dtype.adaln_modulate`, each gated
residual followed by a modulated norm on
:func:`~ditops.ops.modulation_model_dtype.adaln_residual_modulate`, the last residual of
each stream (and the single-stream block's only one) on
:func:`~ditops.ops.modulation_model_dtype.adaln_residual`, the fp16 clip where FLUX.2 has
it. The q/k prologue runs on :func:`~ditops.ops.qk_norm_rope.qk_norm_rope` (FLUX.1's
helpers, :mod:`ditops.integrations.flux.forwards`): one call in the single-stream
processor, one for the text and one for the image tokens in the double-stream one. In
exact precision the patched model is bitwise the unpatched one.

Left as diffusers runs it: the shared ``Flux2Modulation`` projections and the timestep,
position and input embeddings (the model's own forward, once per call, not in the
blocks); the linears, the SwiGLU and attention itself (``dispatch_attention_fn`` with the
original processor's backend). The KV-cache processors of the Klein KV pipeline
(``Flux2KVAttnProcessor``, ``Flux2KVParallelSelfAttnProcessor``) and any processor of
another class are kept as they are; the blocks around them are still fused, per-token
modulations included.

No sparse attention: FLUX.2 is an image model; ``attention=`` is refused, naming the
families that serve it. The skeleton's check (:mod:`~ditops.integrations.shared.family`)
refuses, whole and before any change, a model whose block forwards, processors or the
diffusers functions reproduced here differ from the versions checked (fingerprints), or
whose q/k norms the op cannot take; a block with a norm of another kind runs diffusers'
forward.
"""

from __future__ import annotations

from torch import nn

from ditops.integrations.flux.family import qk_norm_problems
from ditops.integrations.flux2.forwards import (
    DOUBLE_BYPASSES,
    SINGLE_BYPASSES,
    FusedFlux2AttnProcessor,
    FusedFlux2ParallelSelfAttnProcessor,
    double_block_forward,
    single_block_forward,
)
from ditops.integrations.shared.adaln_zero import (
    adaln_ops,
    norm_out_blocks,
)
from ditops.integrations.shared.base import is_plain_layer_norm
from ditops.integrations.shared.family import (
    Attention,
    Blocks,
    FamilySpec,
    Fused,
    Relied,
)
from ditops.integrations.shared.fingerprints import known


def _relied_on() -> Relied:
    """The diffusers functions besides the blocks and processors whose arithmetic the
    patch reproduces, with the fingerprints of the versions checked."""
    from diffusers.models import embeddings

    return {
        "apply_rotary_emb": (embeddings.apply_rotary_emb, known("apply_rotary_emb")),
    }  # fmt: skip


def _not_plain(block: nn.Module, names: tuple[str, ...]) -> list[str]:
    """A block whose ``names`` are not LayerNorms without affine (a norm of the user's)
    runs diffusers' forward: the reasons."""
    return [
        f"{name} is a {type(getattr(block, name, None)).__name__}, not a LayerNorm "
        "without affine parameters"
        for name in names
        if not is_plain_layer_norm(getattr(block, name, None))
    ]


def _double_unfused(block: nn.Module, where: str) -> list[str]:
    return _not_plain(block, DOUBLE_BYPASSES)


def _single_unfused(block: nn.Module, where: str) -> list[str]:
    return _not_plain(block, SINGLE_BYPASSES)


SPEC = FamilySpec(
    name="flux2",
    model_classes=("Flux2Transformer2DModel",),
    summary="fused adaLN chain and attention prologue",
    blocks=(
        Blocks(
            ("transformer_blocks",),
            (Fused("Flux2TransformerBlock.forward", known("Flux2TransformerBlock.forward"),
                   double_block_forward, DOUBLE_BYPASSES, unfused=_double_unfused,
                   attention="attn", prologue=qk_norm_problems),),
        ),
        Blocks(
            ("single_transformer_blocks",),
            (Fused("Flux2SingleTransformerBlock.forward",
                   known("Flux2SingleTransformerBlock.forward"),
                   single_block_forward, SINGLE_BYPASSES, unfused=_single_unfused,
                   attention="attn", prologue=qk_norm_problems),),
        ),
        norm_out_blocks(),
    ),
    ops=adaln_ops,
    attention=Attention(
        {FusedFlux2AttnProcessor.wraps: FusedFlux2AttnProcessor,
         FusedFlux2ParallelSelfAttnProcessor.wraps: FusedFlux2ParallelSelfAttnProcessor},
        {**known("Flux2AttnProcessor.__call__"),
         **known("Flux2ParallelSelfAttnProcessor.__call__")},
        keep_others=True,  # the KV-cache processors (or the user's) stay; blocks fused
    ),
    relied_on=_relied_on,
)  # fmt: skip
