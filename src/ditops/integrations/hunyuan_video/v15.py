"""Patching diffusers' ``HunyuanVideo15Transformer3DModel`` (HunyuanVideo-1.5 t2v and i2v).

HunyuanVideo-1.5 (diffusers 0.42) has double-stream blocks only,
``HunyuanVideo15TransformerBlock``, whose forward is HunyuanVideo's
``HunyuanVideoTransformerBlock.forward`` character for character (the fingerprints
below are the same): the patch runs :func:`~ditops.integrations.hunyuan_video.
double_block_forward` on them, ``norm_out`` on ``adaln_modulate``, and the attention on
:class:`~ditops.integrations.hunyuan_video.attention.HunyuanVideoAttnProcessor` with
``text_mask=True``: its processor, ``HunyuanVideo15AttnProcessor2_0``, is HunyuanVideo's
double-stream path except that it is given the ``[B, text]`` mask of the joint text (the
model puts the valid image, ByT5 and MLLM tokens first, padding after) and makes a
``[B, 1, N, N]`` mask from it, masking padded text as keys and as queries; ditops makes
it with the same code. In exact precision the patched model is bitwise the unpatched one.

Left as diffusers runs them: the token refiner and the ByT5 and image projections (their
``nn.LayerNorm`` have affine parameters), the embeddings. Sparse attention is
HunyuanVideo's (video queries block-sparse over the kept text keys and the video keys,
text queries dense with their rows of the mask).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ditops.integrations.hunyuan_video.family import HunyuanVideoFamily, Spec
from ditops.integrations.hunyuan_video.family import relied_on as hunyuan_relied_on
from ditops.integrations.shared.adaln_zero import DIFFUSERS_042

_SHARED = (
    "AdaLayerNormZero.forward",
    "AdaLayerNormContinuous.forward",
    "RMSNorm.forward",
    "apply_rotary_emb",
)


def _relied_on() -> dict[str, tuple[Callable[..., Any], dict[str, str]]]:
    """Every diffusers function whose arithmetic the patch reproduces, with the
    fingerprints of the versions this module was checked against."""
    from diffusers.models.transformers import transformer_hunyuan_video15 as hv15

    shared = hunyuan_relied_on()
    return {
        # the same fingerprint as HunyuanVideoTransformerBlock.forward: the same code
        "HunyuanVideo15TransformerBlock.forward": (
            hv15.HunyuanVideo15TransformerBlock.forward, {"2905bc608785d8af": DIFFUSERS_042}
        ),
        "HunyuanVideo15AttnProcessor2_0.__call__": (
            hv15.HunyuanVideo15AttnProcessor2_0.__call__, {"a81a49107227f5da": DIFFUSERS_042}
        ),
        **{name: shared[name] for name in _SHARED},
    }  # fmt: skip


def _spec() -> Spec:
    from diffusers.models.transformers import transformer_hunyuan_video15 as hv15

    return Spec(
        blocks={"transformer_blocks": (hv15.HunyuanVideo15TransformerBlock,)},
        processor=hv15.HunyuanVideo15AttnProcessor2_0,
        relied_on=lambda: _relied_on(),
    )


class HunyuanVideo15Family(HunyuanVideoFamily):
    """diffusers' ``HunyuanVideo15Transformer3DModel``: fused adaLN chain and attention
    prologue, optional block-sparse video self-attention (HunyuanVideo's family, with
    HunyuanVideo-1.5's model class, blocks and ``[B, text]`` text mask)."""

    name = "hunyuan_video15"
    model_classes = ("HunyuanVideo15Transformer3DModel",)
    blocks_attr = "transformer_blocks"
    text_mask = True

    @staticmethod
    def spec() -> Spec:
        return _spec()
