"""Patching diffusers' ``ZImageTransformer2DModel`` (Z-Image, its Omni variant).

Every block of Z-Image is a ``ZImageTransformerBlock`` (single-stream, diffusers 0.42): the
noise refiner's and the main layers' with modulation, the context (and SigLIP) refiners'
without. Every norm is diffusers' ``RMSNorm`` (``x * rsqrt(mean(x.float()^2) + eps)`` in
fp32, rounded to a bf16/fp16 weight's dtype, times the weight), and every step is in the
model dtype::

    # modulation=True: adaLN_modulation is one Linear, [B, 4 D]
    scale_msa, gate_msa, scale_mlp, gate_mlp = mod(adaln_input).unsqueeze(1).chunk(4, 2)
    gate = gate.tanh();  scale = 1.0 + scale    # [B, 1, D]; Omni (noise_mask): the noisy and
                                                # clean tokens' picked by select_per_token
    a = attention(attention_norm1(x) * scale_msa, mask, freqs_cis)
    x = x + gate_msa * attention_norm2(a)
    x = x + gate_mlp * ffn_norm2(feed_forward(ffn_norm1(x) * scale_mlp))
    # modulation=False: the same without the scales and gates

``ZSingleStreamAttnProcessor``: q, k, v ``[B, L, H, D]``; q and k through ``norm_q`` /
``norm_k`` (diffusers' RMSNorm per head), then rotated: pairs ``(x[2i], x[2i+1])`` of
``x.float()`` as complex numbers times the complex64 table ``freqs_cis[:, :, None]``
(``[B, L, 1, D/2]``, padded per sample), rounded back to x's dtype; attention with the
padding mask; ``to_out``. The final layer (``all_final_layer``, one per patch size,
``FinalLayer``) is ``linear(norm_final(x) * (1.0 + adaLN_modulation(c)))``, ``norm_final``
a LayerNorm without affine.

The patched model runs the same expressions on ditops' ops: ``attention_norm1(x) *
scale_msa`` and ``ffn_norm1(x) * scale_mlp`` on
:func:`~ditops.ops.rms_norm_scale.rms_norm_scale` (the norm rounded to the weight's dtype,
times the weight, times the scale, each rounded as eager), the other RMSNorms (and the
unmodulated refiners') on :func:`~ditops.ops.qk_norm_rope.rms_norm`
(``convention="diffusers"``), both residuals on
:func:`~ditops.ops.modulation_model_dtype.adaln_residual` (without a gate where the block
has none), the final layer's modulated norm on
:func:`~ditops.ops.modulation_model_dtype.adaln_modulate` (scale only), and the prologue on
:func:`~ditops.ops.qk_norm_rope.qk_norm_rope` (``convention="diffusers"``, the table's real
and imaginary parts as cos and sin, per sample: see
:mod:`~ditops.integrations.shared.complex_rope`). Off the CPU, exact precision runs
diffusers' blocks and processor (an NPU's diffusers RMSNorm calls ``npu_rms_norm``, a GPU
may contract the complex product into fused multiply-adds; elsewhere the ops' exact
meaning is diffusers' expressions: nothing to gain). In exact precision the patched model
is bitwise the unpatched one.

Left as diffusers runs it, and why: the modulation projections, ``tanh`` and ``1 +
scale`` (``[B, 1, D]``: nothing to fuse); attention, projections, the feed-forward; the
caption embedder's RMSNorm; the timestep and rotary embeddings and the sequence packing.

The skeleton's check (:mod:`~ditops.integrations.shared.family`) refuses a model whose
blocks, norms, processors or relied-on diffusers functions differ from those checked; a
block whose norms are not diffusers' RMSNorm with a weight and no bias runs diffusers'
forward. A model with ``qk_norm=False`` is refused (no q/k norms: the prologue is only the
rotation). No sparse attention.
"""

from __future__ import annotations

from torch import nn

from ditops.integrations.shared.adaln_zero import AdaLNOps
from ditops.integrations.shared.base import is_plain_layer_norm
from ditops.integrations.shared.family import (
    Attention,
    Blocks,
    DeclaredFamily,
    FamilySpec,
    Fused,
    Relied,
)
from ditops.integrations.shared.fingerprints import known
from ditops.integrations.shared.qk_norms import rms_problems
from ditops.integrations.z_image.forwards import (
    BLOCK_BYPASSES,
    FINAL_BYPASSES,
    FusedZImageAttnProcessor,
    block_forward,
    final_forward,
)


def _relied_on() -> Relied:
    """The diffusers functions besides the blocks and the processor whose arithmetic the
    patch reproduces, with the fingerprints of the versions checked."""
    from diffusers.models import normalization
    from diffusers.models.transformers import transformer_z_image as tz

    relied: Relied = {
        "RMSNorm.forward": (normalization.RMSNorm.forward, known("RMSNorm.forward")),
    }
    if hasattr(tz, "select_per_token"):  # (0.36 has no per-token modulation: nothing to pick)
        relied["select_per_token"] = (tz.select_per_token, known("select_per_token"))
    return relied


def _block_unfused(block: nn.Module, where: str) -> list[str]:
    """A block whose norms are not what the fused forward computes (a norm of the user's,
    or one without a weight) runs diffusers' forward."""
    from diffusers.models.normalization import RMSNorm

    found = []
    for name in BLOCK_BYPASSES:
        norm = getattr(block, name, None)
        if type(norm) is not RMSNorm or norm.weight is None or norm.bias is not None:
            found.append(
                f"{name} is a {type(norm).__name__}, not diffusers' RMSNorm with a weight "
                "and no bias"
            )
    return found


def _prologue_problems(attn: nn.Module, where: str) -> list[str]:
    if attn.norm_q is None and attn.norm_k is None:
        return [f"{where} has no q/k norms (qk_norm=False): ditops fuses Z-Image's prologue "
                "of models with qk_norm=True"]  # fmt: skip
    return rms_problems(attn, ("norm_q", "norm_k"), where)


def _final_problems(layer: nn.Module, where: str) -> list[str]:
    if not is_plain_layer_norm(getattr(layer, "norm_final", None)):
        return [f"{where}.norm_final is not a LayerNorm without affine parameters"]
    return []


SPEC = FamilySpec(
    name="z_image",
    model_classes=("ZImageTransformer2DModel",),
    summary="fused norms, residuals and attention prologue",
    blocks=(
        Blocks(
            ("layers", "noise_refiner", "context_refiner", "siglip_refiner"),
            (Fused("ZImageTransformerBlock.forward", known("ZImageTransformerBlock.forward"),
                   block_forward, BLOCK_BYPASSES, unfused=_block_unfused, attention="attention",
                   prologue=_prologue_problems),),
            required=True,
        ),
        Blocks(
            ("all_final_layer",),
            (Fused("FinalLayer.forward", known("FinalLayer.forward"), final_forward,
                   FINAL_BYPASSES, problems=_final_problems, kind="final layers"),),
            required=True,
        ),
    ),
    ops=AdaLNOps.of,
    attention=Attention(
        {FusedZImageAttnProcessor.wraps: FusedZImageAttnProcessor},
        known("ZSingleStreamAttnProcessor.__call__"),
        keep_others=True,  # a processor of the user's stays; the blocks are fused
    ),
    relied_on=_relied_on,
)  # fmt: skip

#: diffusers' ``ZImageTransformer2DModel``: fused norms, residuals and attention prologue.
ZImageFamily = DeclaredFamily(SPEC)
