"""Which sglang op classes ditops serves, and with which forward (``fn(module, *args)``).

The classes are sglang's exact ones (``CustomOp`` looks a forward up by ``type(op)``:
a subclass sglang or a vendor adds keeps its own forward).
"""

from __future__ import annotations

import functools
from typing import Any

from ditops.integrations.sglang import elementwise as ew
from ditops.integrations.sglang import norms, rotary

#: (sglang module, class name, ditops' forward).
SERVED: tuple[tuple[str, str, Any], ...] = (
    ("layernorm", "FP32LayerNorm", norms.fp32_layer_norm_forward),
    ("layernorm", "RMSNorm", norms.rms_norm_forward),
    ("layernorm", "LayerNormScaleShift", norms.layer_norm_scale_shift_forward),
    (
        "layernorm",
        "ScaleResidualLayerNormScaleShift",
        norms.scale_residual_layer_norm_scale_shift_forward,
    ),
    ("layernorm", "RMSNormNoWeight", ew.rms_norm_no_weight_forward),
    ("layernorm", "RMSNormScaleShift", ew.rms_norm_scale_shift_forward),
    (
        "layernorm",
        "ScaleResidualRMSNormScaleShift",
        ew.scale_residual_rms_norm_scale_shift_forward,
    ),
    ("elementwise", "MulAdd", ew.mul_add_forward),
    ("activation", "GeluAndMul", ew.gelu_and_mul_forward),
    ("activation", "NewGELU", ew.new_gelu_forward),
    ("rotary_embedding.base", "RotaryEmbedding", rotary.rotary_embedding_forward),
)


@functools.cache
def forwards() -> dict[type, Any]:
    """sglang's class -> ditops' forward, for the classes this sglang release has."""
    import importlib

    found: dict[type, Any] = {}
    for module, name, fn in SERVED:
        mod = importlib.import_module(f"sglang.multimodal_gen.runtime.layers.{module}")
        cls = getattr(mod, name, None)
        if cls is not None:
            found[cls] = fn
    return found
