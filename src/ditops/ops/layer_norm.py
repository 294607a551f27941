"""``fp32_layer_norm``: a LayerNorm computed in fp32 and returned in the input's dtype.

Meaning (``forward_native``), the same as diffusers' ``FP32LayerNorm``::

    F.layer_norm(x.float(), shape, weight.float(), bias.float(), eps).to(x.dtype)

Precision contract (docs/precision.md): ``exact`` is bitwise equal to ``forward_native`` on
the same device; ``fast`` is at most 1 ulp of the output dtype away from it, on at
most 1e-3 of the elements.

Paths: ``cpu`` (exact and fast), ``cuda``/``hip``/``xpu`` through a Triton kernel
(fast; exact runs native), ``npu`` (fast) through the NPU layer norm
(:class:`ditops.backends.npu.NpuLayerNorm`). The module users put in models is
:class:`ditops.layers.norm.FP32LayerNorm`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ditops.backends.npu import NPU_LAYER_NORM
from ditops.backends.triton import TRITON
from ditops.core.calls import OpCall
from ditops.core.checks import FLOATS, check_eps
from ditops.core.op import CustomOp, register_op
from ditops.core.paths import path
from ditops.core.public import public_op

# aclnnLayerNorm, behind both NPU layer norms, takes 1 to 8 dims.
NPU_MAX_DIMS = 8


@dataclass(slots=True)
class LayerNormCall(OpCall):
    x: torch.Tensor
    shape: tuple[int, ...]
    weight: torch.Tensor | None  # fp32 (cast afresh each call: no stale cache after .data edits)
    bias: torch.Tensor | None
    eps: float


def _npu_reasons(c: LayerNormCall) -> list[str]:
    if c.x.dim() > NPU_MAX_DIMS:
        return [f"{c.x.dim()}-D input: the NPU layer norm takes at most {NPU_MAX_DIMS} dims"]
    return []


@register_op("fp32_layer_norm")
class FP32LayerNormOp(CustomOp):
    """``fp32_layer_norm(x, normalized_shape, weight, bias, eps)``; see the module docstring."""

    def prepare(  # type: ignore[override]
        self,
        x: torch.Tensor,
        normalized_shape: tuple[int, ...],
        weight: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        eps: float = 1e-5,
    ) -> LayerNormCall:
        op = "FP32LayerNorm"
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{op}: expected a tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(
                f"{op}: input dtype {x.dtype} is not a floating point type; "
                "expected float32, bfloat16 or float16"
            )
        shape, k = tuple(normalized_shape), len(normalized_shape)
        if x.dim() < k or tuple(x.shape[x.dim() - k :]) != shape:
            raise ValueError(
                f"{op}: input of shape {tuple(x.shape)} does not end in normalized_shape "
                f"{shape}; expected trailing dims {shape}, "
                f"got {tuple(x.shape[max(0, x.dim() - k) :])}"
            )
        w = None if weight is None else weight.float()
        b = None if bias is None else bias.float()
        return LayerNormCall(x, shape, w, b, check_eps(op, eps))

    def forward_native(self, c: LayerNormCall) -> torch.Tensor:
        return F.layer_norm(c.x.float(), c.shape, c.weight, c.bias, c.eps).to(c.x.dtype)

    @path(precisions=("exact", "fast"), dtypes=FLOATS, inference_only=True)
    def forward_cpu(self, c: LayerNormCall) -> torch.Tensor:
        from ditops.kernels.cpu.layer_norm import fp32_layer_norm

        return fp32_layer_norm(c.x, list(c.shape), c.weight, c.bias, c.eps, c.exact)

    @path("cuda", "hip", "xpu", backend=TRITON, dtypes=FLOATS, inference_only=True)
    def forward_cuda(self, c: LayerNormCall) -> torch.Tensor:
        from ditops.kernels.triton.layer_norm import fp32_layer_norm

        # The kernel normalises the last dim: a multi-dim normalized_shape is collapsed.
        n = math.prod(c.shape)
        rows = c.x.reshape(*c.x.shape[: c.x.dim() - len(c.shape)], n)
        w = None if c.weight is None else c.weight.reshape(n)
        b = None if c.bias is None else c.bias.reshape(n)
        return fp32_layer_norm(rows, w, b, c.eps).reshape(c.x.shape)

    @path(backend=NPU_LAYER_NORM, dtypes=FLOATS, inference_only=True, reasons=_npu_reasons)
    def forward_npu(self, c: LayerNormCall) -> torch.Tensor:
        return NPU_LAYER_NORM.layer_norm(c.x, c.shape, c.weight, c.bias, c.eps).to(c.x.dtype)


@public_op(FP32LayerNormOp())
def fp32_layer_norm(
    x: torch.Tensor,
    normalized_shape: tuple[int, ...],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """A LayerNorm computed in fp32 and returned in x's dtype (diffusers' ``FP32LayerNorm``).

    Meaning::

        F.layer_norm(x.float(), normalized_shape, weight.float(), bias.float(),
                     eps).to(x.dtype)

    The module users put in models is :class:`ditops.FP32LayerNorm`.

    Shapes and dtypes:
        x: ``[..., *normalized_shape]``, fp32/bf16/fp16.
        normalized_shape: the trailing dims normalised, a tuple of ints.
        weight, bias: ``normalized_shape``-shaped, any float dtype (widened to fp32), or None.
        eps: a positive float.

    Returns x's shape and dtype.

    Precision: ``exact`` is bitwise the meaning (CPU); ``fast`` is within 1 ulp of the
    output dtype on at most 1e-3 of the elements. NaN and inf propagate as in the meaning.
    """
