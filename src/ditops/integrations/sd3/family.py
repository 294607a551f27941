"""Patching diffusers' ``SD3Transformer2DModel`` (Stable Diffusion 3 and 3.5).

Every block is a ``JointTransformerBlock`` (MMDiT: image and text tokens with their own
weights, joint attention), adaLN-Zero in the model dtype (diffusers 0.42). With ``e =
linear(silu(temb))`` chunked as the norm says, ``LN`` a LayerNorm without affine::

    n = LN(h) * (1 + scale[:, None]) + shift[:, None]          # norm1: AdaLayerNormZero
    c_n = LN(c) * (1 + c_scale[:, None]) + c_shift[:, None]    # norm1_context, the same
    a, c_a = attn(n, c_n)                                      # joint attention
    h = h + gate.unsqueeze(1) * a
    n = norm2(h) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
    h = h + gate_mlp.unsqueeze(1) * ff(n)                      # ff chunked if asked
    c = c + c_gate.unsqueeze(1) * c_a;  c_n = norm2_context(c) * (1 + ...) + ...
    c = c + c_gate_mlp.unsqueeze(1) * ff_context(c_n)

SD3.5's dual-attention blocks (``use_dual_attention``) have ``norm1`` an
``SD35AdaLayerNormZeroX`` (nine chunks) and a second, image-only attention ``attn2``::

    y = LN(h);  n = y * (1 + scale) + shift;  n2 = y * (1 + scale2) + shift2
    h = h + gate * attn(n, c_n)[0];  h = h + gate2 * attn2(n2);  then norm2 as above

The last block (``context_pre_only``) has ``norm1_context`` an ``AdaLayerNormContinuous``
(``e = linear(silu(temb).to(c.dtype))``; ``c_n = LN(c) * (1 + scale)[:, None] +
shift[:, None]``), no text MLP half, and returns ``(None, h)``; the model's ``norm_out``
is that norm again. ``JointAttnProcessor2_0`` projects q, k, v (and the text's with
``add_*_proj``) to ``[B, H, L, D]``, applies ``norm_q``/``norm_k`` (and
``norm_added_q``/``norm_added_k``) where present, concatenates ``[image, text]``, runs
``F.scaled_dot_product_attention`` (no mask), splits, and projects out (``to_add_out``
unless ``context_pre_only``). SD3.5 (``qk_norm="rms_norm"``) has those norms: diffusers'
``RMSNorm`` over the head dim, ``x * rsqrt(mean(x.float()^2) + eps)``, rounded to the
weight's dtype if half, times the weight.

The patched model runs the same expressions on ditops' ops: every modulated norm on
:func:`~ditops.ops.modulation_model_dtype.adaln_modulate` (SD3.5's ``norm1`` twice: the
op norms ``h`` for each modulation, the same values), the gated residual that ``norm2``
reads on :func:`~ditops.ops.modulation_model_dtype.adaln_residual_modulate`, the other
residuals on :func:`~ditops.ops.modulation_model_dtype.adaln_residual`, ``norm_out`` and
the last ``norm1_context`` on ``adaln_modulate``; the feed-forwards, projections and
attention itself are diffusers' modules. Attention runs
:class:`~ditops.integrations.sd3.forwards.FusedSD3AttnProcessor`, which is
``JointAttnProcessor2_0`` with each q/k RMSNorm on :func:`~ditops.ops.qk_norm_rope.rms_norm`
(``convention="diffusers"``, one call per norm: the four norms have their own weights and
SD3 has no rotary embedding, so ``qk_norm_rope`` does not apply). In exact precision the
patched model is bitwise the unpatched one.

Left as diffusers runs it: SD3's processors where there is no q/k norm to fuse
(``qk_norm=None``, SD3.0) or norms of another kind (``layer_norm``: no ditops op is that
arithmetic), counted as kept with the reason; processors of other classes (IP-Adapter's,
PAG's, the fused-projection one: kept, the blocks still fused). A block whose norms are
of another kind runs diffusers' forward. Sparse attention is refused (image model).

This module declares the family (:data:`SPEC`); the fused forward and the processor are
in :mod:`ditops.integrations.sd3.forwards`.
"""

from __future__ import annotations

from torch import nn

from ditops.integrations.sd3.forwards import (
    JOINT_BYPASSES,
    QK_NORMS,
    FusedSD3AttnProcessor,
    joint_block_forward,
)
from ditops.integrations.shared.adaln_zero import (
    AdaLNOps,
    norm_out_forward,
    norm_out_problems,
    relied_on_norms,
    zero_norm_problem,
)
from ditops.integrations.shared.base import is_plain_layer_norm
from ditops.integrations.shared.family import Attention, Blocks, FamilySpec, Fused
from ditops.integrations.shared.fingerprints import known, relied

NORM_OUT_BYPASSES = ("norm",)


def _norm_problem(block: nn.Module, name: str, cls_name: str) -> str | None:
    """Why ``block.<name>`` is not a ``cls_name`` (of diffusers) over a LayerNorm without
    affine, or None."""
    from diffusers.models import normalization

    norm = getattr(block, name, None)
    if type(norm) is not getattr(normalization, cls_name) or not is_plain_layer_norm(
        getattr(norm, "norm", None)
    ):
        return f"{name} is not an {cls_name} over a LayerNorm without affine"
    return None


def _joint_unfused(block: nn.Module, where: str) -> list[str]:
    """A block whose norms are not those the fused forward computes (a norm of the
    user's, or not the kind its flags say) runs diffusers' forward."""
    dual, pre_only = bool(block.use_dual_attention), bool(block.context_pre_only)
    if dual:
        found = [_norm_problem(block, "norm1", "SD35AdaLayerNormZeroX")]
        if block.attn2 is None:
            found.append("use_dual_attention without attn2")
    else:
        found = [zero_norm_problem(block, "norm1", single=False)]
    if pre_only:
        found.append(_norm_problem(block, "norm1_context", "AdaLayerNormContinuous"))
        found += norm_out_problems(block.norm1_context, "norm1_context")
    else:
        found.append(zero_norm_problem(block, "norm1_context", single=False))
    for name in ("norm2",) if pre_only else ("norm2", "norm2_context"):
        norm = getattr(block, name, None)
        if not is_plain_layer_norm(norm):
            found.append(f"{name} is a {type(norm).__name__}, not a LayerNorm without affine")
    return [f for f in found if f]


def qk_plain(attn: nn.Module, where: str) -> list[str]:
    """Why the attention module's processor has no prologue ditops fuses: no q/k norm
    (SD3.0), or one that is not diffusers' RMSNorm without bias."""
    from diffusers.models.normalization import RMSNorm

    norms = [(n, getattr(attn, n, None)) for n in QK_NORMS]
    norms = [(n, m) for n, m in norms if m is not None]
    if not norms:
        return ["no q/k norm (qk_norm=None): nothing to fuse before attention"]
    for name, norm in norms:
        if type(norm) is not RMSNorm or norm.bias is not None:
            return [
                f"{name} is a {type(norm).__name__}, not diffusers' RMSNorm without bias: "
                "no ditops op computes it"
            ]
    return []


SPEC = FamilySpec(
    name="sd3",
    model_classes=("SD3Transformer2DModel",),
    summary="fused adaLN chain (SD3.5's dual attention too) and q/k RMSNorms",
    blocks=(
        Blocks(
            ("transformer_blocks",),
            (Fused("JointTransformerBlock.forward", known("JointTransformerBlock.forward"),
                   joint_block_forward, JOINT_BYPASSES, unfused=_joint_unfused,
                   attention=("attn", "attn2"), plain=qk_plain),),
        ),
        Blocks(
            ("norm_out",),
            (Fused("AdaLayerNormContinuous.forward", known("AdaLayerNormContinuous.forward"),
                   norm_out_forward, NORM_OUT_BYPASSES, problems=norm_out_problems,
                   kind="output norm"),),
            required=True,
        ),
    ),
    ops=AdaLNOps.of,
    attention=Attention(
        {FusedSD3AttnProcessor.wraps: FusedSD3AttnProcessor},
        known("JointAttnProcessor2_0.__call__"),
        keep_others=True,  # IP-Adapter's, PAG's (or the user's) stay; the blocks are fused
    ),
    relied_on=lambda: {
        **relied_on_norms(),
        **relied("diffusers.models.normalization", "SD35AdaLayerNormZeroX.forward",
                 "RMSNorm.forward"),
        **relied("diffusers.models.attention", "_chunked_feed_forward"),
    },
)  # fmt: skip
