"""ditops: fast, portable operators for diffusion-transformer inference.

Public names only; the docs (docs/, built with mkdocs) say how to use them.
"""

from __future__ import annotations

from ditops._version import __version__ as __version__
from ditops.attention import BlockSparseConfig
from ditops.config import configure, override
from ditops.custom_op import BackendUnavailableError, CustomOp, explain, registered_ops
from ditops.integrations import (
    PatchError,
    explain_patch,
    patch,
    set_step,
    sparse_densities,
    unpatch,
)
from ditops.layers.modulation import LayerNormScaleShift, ScaleResidualLayerNormScaleShift
from ditops.layers.norm import FP32LayerNorm
from ditops.layers.rms_norm import RMSNorm
from ditops.layers.sparse_attention import BlockSparseAttention
from ditops.ops.block_sparse_attention import block_sparse_attention
from ditops.ops.estimate_block_mask import estimate_block_mask
from ditops.ops.gelu import gelu_tanh_bias
from ditops.ops.layer_norm import fp32_layer_norm
from ditops.ops.modulation_fp32 import (
    gated_residual,
    layer_norm_scale_shift,
    scale_residual_layer_norm_scale_shift,
)
from ditops.ops.modulation_model_dtype import (
    adaln_modulate,
    adaln_residual,
    adaln_residual_modulate,
)
from ditops.ops.qk_norm_rope import qk_norm_rope, rms_norm, rotary_embedding
from ditops.ops.rms_norm_scale import rms_norm_scale
from ditops.platform import device_kind, force_device_kind, visible_devices

__all__ = [
    "BackendUnavailableError",
    "BlockSparseAttention",
    "BlockSparseConfig",
    "LayerNormScaleShift",
    "RMSNorm",
    "adaln_modulate",
    "adaln_residual",
    "adaln_residual_modulate",
    "ScaleResidualLayerNormScaleShift",
    "block_sparse_attention",
    "estimate_block_mask",
    "fp32_layer_norm",
    "gated_residual",
    "gelu_tanh_bias",
    "layer_norm_scale_shift",
    "qk_norm_rope",
    "rms_norm",
    "rms_norm_scale",
    "rotary_embedding",
    "scale_residual_layer_norm_scale_shift",
    "CustomOp",
    "FP32LayerNorm",
    "PatchError",
    "configure",
    "device_kind",
    "explain",
    "explain_patch",
    "sparse_densities",
    "force_device_kind",
    "override",
    "patch",
    "registered_ops",
    "set_step",
    "unpatch",
    "visible_devices",
]
