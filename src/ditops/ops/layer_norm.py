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
from ditops.core.checks import FLOATS, as_int, check_eps, dtype_name
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


def normalized_dims(op: str, value: object) -> tuple[int, ...]:
    """``normalized_shape`` as ``nn.LayerNorm`` takes it (an int, or a sequence of ints),
    as a tuple; anything else is named, never printed (a tensor passed by mistake)."""
    one = as_int(value)
    if one is not None:
        dims: tuple[object, ...] = (one,)
    elif isinstance(value, (list, tuple, torch.Size)):
        dims = tuple(value)
    else:
        what = (
            f"a Tensor of shape {list(value.shape)}"
            if isinstance(value, torch.Tensor)
            else type(value).__name__
        )
        raise TypeError(
            f"{op}: normalized_shape must be an int or a sequence of ints (the trailing "
            f"dims of the input), got {what}"
        )
    out = tuple(as_int(d) for d in dims)
    if not out or any(d is None or d < 0 for d in out):
        shown = [type(d).__name__ if as_int(d) is None else d for d in dims]
        raise ValueError(
            f"{op}: normalized_shape must be one or more ints >= 0 (the trailing dims of "
            f"the input), got {shown}"
        )
    return out  # type: ignore[return-value]


def check_affine(
    op: str, name: str, p: object, shape: tuple[int, ...], device: torch.device
) -> None:
    """A weight or bias: None, or a float tensor of ``normalized_shape`` on the input's
    device (checked here, as the other ops do, rather than left to torch)."""
    if p is None:
        return
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a tensor or None, got {type(p).__name__}")
    if not p.is_floating_point():
        raise TypeError(f"{op}: {name} has dtype {dtype_name(p.dtype)}; expected a float dtype")
    if tuple(p.shape) != shape:
        raise ValueError(
            f"{op}: {name} must have shape {list(shape)} (normalized_shape), got {list(p.shape)}"
        )
    if p.device != device:
        raise ValueError(f"{op}: {name} is on {p.device} but the input is on {device}")


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
        shape = normalized_dims(op, normalized_shape)
        k = len(shape)
        if x.dim() < k or tuple(x.shape[x.dim() - k :]) != shape:
            raise ValueError(
                f"{op}: input of shape {tuple(x.shape)} does not end in normalized_shape "
                f"{shape}; expected trailing dims {shape}, "
                f"got {tuple(x.shape[max(0, x.dim() - k) :])}"
            )
        for name, p in (("weight", weight), ("bias", bias)):
            check_affine(op, name, p, shape, x.device)
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
