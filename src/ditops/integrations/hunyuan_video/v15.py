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

from ditops.integrations.hunyuan_video.attention import HunyuanVideo15AttnProcessor
from ditops.integrations.hunyuan_video.family import DOUBLE_BLOCK, NORM_OUT, SPARSE, relied_on
from ditops.integrations.shared.adaln_zero import adaln_ops
from ditops.integrations.shared.family import Attention, Blocks, FamilySpec
from ditops.integrations.shared.fingerprints import known

SPEC = FamilySpec(
    name="hunyuan_video15",
    model_classes=("HunyuanVideo15Transformer3DModel",),
    summary=(
        "fused adaLN chain and attention prologue, optional block-sparse video "
        "self-attention (HunyuanVideo's, with HunyuanVideo-1.5's text mask)"
    ),
    # HunyuanVideo15TransformerBlock.forward is HunyuanVideoTransformerBlock.forward
    # character for character: the same fingerprint, the same fused kind.
    blocks=(Blocks(("transformer_blocks",), (DOUBLE_BLOCK,)), NORM_OUT),
    ops=adaln_ops,
    attention=Attention(
        {HunyuanVideo15AttnProcessor.wraps: HunyuanVideo15AttnProcessor},
        known("HunyuanVideo15AttnProcessor2_0.__call__"),
    ),
    sparse=SPARSE,
    relied_on=relied_on,
)
