"""Patching diffusers' ``QwenImageTransformer2DModel`` (Qwen-Image and its edit models).

Qwen-Image's blocks are all ``QwenImageTransformerBlock`` (double-stream, diffusers 0.42):
image and text tokens with their own weights and joint attention, in the model dtype::

    img_p = img_mod(temb)                       # SiLU, Linear: [B, 6 D]
    txt_p = txt_mod(temb)                       # zero_cond_t: temb's first half
    img_mod1, img_mod2 = img_p.chunk(2, -1);  txt_mod1, txt_mod2 = ...
    shift, scale, gate = mod.chunk(3, -1)       # _modulate: each [B, 1, D], or with
                                                # modulate_index (zero_cond_t) [B, L, D]:
                                                # where(index == 0, first half, second half)
    n = img_norm1(h) * (1 + scale1) + shift1    # LayerNorm without affine
    c_n = txt_norm1(c) * (1 + c_scale1) + c_shift1
    a, c_a = attn(n, c_n, mask, rope)           # the processor below
    h = h + gate1 * a;  c = c + c_gate1 * c_a
    h = h + gate2 * img_mlp(img_norm2(h) * (1 + scale2) + shift2)
    c = c + c_gate2 * txt_mlp(txt_norm2(c) * (1 + c_scale2) + c_shift2)
    fp16: c = c.clip(-65504, 65504);  h = h.clip(-65504, 65504)

``QwenDoubleStreamAttnProcessor2_0``: q, k, v of each stream ``[B, L, H, D]``; q and k
through diffusers' ``RMSNorm`` per head (image: ``norm_q``/``norm_k``, text:
``norm_added_q``/``norm_added_k``: ``x * rsqrt(mean(x.float()^2) + eps)`` in fp32, rounded
to a bf16/fp16 weight's dtype, times the weight), then rotated by
``apply_rotary_emb_qwen(x, freqs, use_real=False)``: pairs ``(x[2i], x[2i+1])`` of
``x.float()`` as complex numbers times ``QwenEmbedRope``'s complex64 table ``[L, D/2]``
(image rows and text rows apart), rounded back to x's dtype; then attention over
``cat([text, image])`` with the text mask, split, ``to_out`` / ``to_add_out``.
The output norm ``norm_out`` (``AdaLayerNormContinuous``) is ``LN(h) * (1 + scale) +
shift``.

The patched model runs the same expressions on ditops' ops: each first modulated norm on
:func:`~ditops.ops.modulation_model_dtype.adaln_modulate`, each gated residual followed by
the second modulated norm on
:func:`~ditops.ops.modulation_model_dtype.adaln_residual_modulate` (the per-token
modulations of ``zero_cond_t`` too: selected as diffusers does, ``[B, L, D]``), the last
residual of each stream on :func:`~ditops.ops.modulation_model_dtype.adaln_residual`, the
fp16 clip where Qwen-Image has it, the output norm on ``adaln_modulate``. The prologue runs
on :func:`~ditops.ops.qk_norm_rope.qk_norm_rope` (``convention="diffusers"``, interleaved
pairs, the table's real and imaginary parts as cos and sin), one call per stream: the
complex product ``(a + bi)(c + di) = (ac - bd) + (ad + bc)i`` in fp32 is the op's ``x * cos
+ rotate(x) * sin`` term for term (checked bitwise on the CPU). Off the CPU, exact precision
runs diffusers' processor: a GPU may contract the complex product into fused multiply-adds,
which the op's meaning does not. In exact precision the patched model is bitwise the
unpatched one.

Older releases (``docs/releases.md``): diffusers 0.37-0.38's model builds the joint mask
and hands it to the processor as ``attention_mask``; 0.35-0.36's processor reads no text
mask at all and projects the split outputs without contiguous copies. The fused processor
reproduces the arithmetic of the release whose processor it wraps (chosen when it is
built); 0.35-0.36's blocks have no ``zero_cond_t``, the same arithmetic without it.

Left as diffusers runs it: the modulation projections (``img_mod``/``txt_mod``), the MLPs,
the projections and attention itself, the text input norm ``txt_norm`` (a model-level
RMSNorm over the text once per call), the timestep and rotary embeddings.

Before changing anything the skeleton's check (:mod:`~ditops.integrations.shared.family`)
compares the blocks, norms and processors against what this module was written for and
the source of every diffusers function whose arithmetic it reproduces against the
fingerprints of the versions checked: a model that does not match is refused whole.
Processors of another class are kept as they are (the blocks are still fused). A block
whose norms are not LayerNorms without affine runs diffusers' forward. No sparse attention.
"""

from __future__ import annotations

from torch import nn

from ditops.integrations.qwen_image.forwards import (
    BLOCK_BYPASSES,
    FusedQwenImageAttnProcessor,
    block_forward,
)
from ditops.integrations.shared.adaln_zero import (
    AdaLNOps,
    norm_out_forward,
    norm_out_problems,
)
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


def _relied_on() -> Relied:
    """The diffusers functions besides the blocks and the processor whose arithmetic the
    patch reproduces, with the fingerprints of the versions checked."""
    from diffusers.models import normalization
    from diffusers.models.transformers import transformer_qwenimage as tq

    return {
        "QwenImageTransformerBlock._modulate": (
            tq.QwenImageTransformerBlock._modulate, known("QwenImageTransformerBlock._modulate")),
        "apply_rotary_emb_qwen": (tq.apply_rotary_emb_qwen, known("apply_rotary_emb_qwen")),
        "RMSNorm.forward": (normalization.RMSNorm.forward, known("RMSNorm.forward")),
        "AdaLayerNormContinuous.forward": (
            normalization.AdaLayerNormContinuous.forward, known("AdaLayerNormContinuous.forward")),
    }  # fmt: skip


def _block_unfused(block: nn.Module, where: str) -> list[str]:
    """A block whose norms are not what the fused forward computes (a norm of the user's,
    or of another kind) runs diffusers' forward."""
    return [
        f"{name} is a {type(getattr(block, name, None)).__name__}, not a LayerNorm without "
        "affine parameters"
        for name in BLOCK_BYPASSES
        if not is_plain_layer_norm(getattr(block, name, None))
    ]


def _prologue_problems(attn: nn.Module, where: str) -> list[str]:
    """The q/k norms of both streams: diffusers' RMSNorm over the head dim with a weight."""
    return [
        *rms_problems(attn, ("norm_q", "norm_k"), where),
        *rms_problems(attn, ("norm_added_q", "norm_added_k"), where),
    ]


SPEC = FamilySpec(
    name="qwen_image",
    model_classes=("QwenImageTransformer2DModel",),
    summary="fused adaLN chain and attention prologue",
    blocks=(
        Blocks(
            ("transformer_blocks",),
            (Fused("QwenImageTransformerBlock.forward", known("QwenImageTransformerBlock.forward"),
                   block_forward, BLOCK_BYPASSES, unfused=_block_unfused, attention="attn",
                   prologue=_prologue_problems),),
            required=True,
        ),
        Blocks(
            ("norm_out",),
            (Fused("AdaLayerNormContinuous.forward", known("AdaLayerNormContinuous.forward"),
                   norm_out_forward, ("norm",), problems=norm_out_problems,
                   kind="output norm"),),
            required=True,
        ),
    ),
    ops=AdaLNOps.of,
    attention=Attention(
        {FusedQwenImageAttnProcessor.wraps: FusedQwenImageAttnProcessor},
        known("QwenDoubleStreamAttnProcessor2_0.__call__"),
        keep_others=True,  # a processor of the user's stays; the blocks are fused
    ),
    relied_on=_relied_on,
)  # fmt: skip

#: diffusers' ``QwenImageTransformer2DModel``: fused adaLN chain and attention prologue.
QwenImageFamily = DeclaredFamily(SPEC)
