"""FP32LayerNorm: low-precision in and out, fp32 inside; a drop-in for ``nn.LayerNorm``.

Meaning (``forward_native``), the same as diffusers' ``FP32LayerNorm``::

    F.layer_norm(x.float(), shape, weight.float(), bias.float(), eps).to(x.dtype)

Precision contract (see README): ``exact`` is bitwise equal to ``forward_native`` on
the same device; ``fast`` is at most 1 ulp of the output dtype away from it, on at
most 1e-3 of the elements.

Paths: ``cpu`` (exact and fast), ``cuda``/``hip``/``xpu`` through a Triton kernel
(fast; exact runs native), ``npu`` (fast) through the legacy ``attentions.layernorm``
(impl_mode 0, fp32 weight and bias) where it is installed, else ``F.layer_norm`` of the
NPU tensor with fp32 weight and bias, run by torch_npu (see
:class:`ditops.backends.npu.NpuLayerNorm`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ditops.backends.npu import NPU_LAYER_NORM
from ditops.backends.triton import TRITON
from ditops.custom_op import CustomOp, fast_path, register_op

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
# aclnnLayerNorm, behind both NPU layer norms, takes 1 to 8 dims.
_NPU_MAX_DIMS = 8


def fp32_params(
    weight: torch.Tensor | None, bias: torch.Tensor | None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """fp32 views of a norm's parameters, cast afresh on every call (fp32 ones as they are).

    No cache: a cache keyed on ``data_ptr``/``_version`` misses edits made through
    ``.data`` (LoRA fusing and weight loaders do that) and would return stale weights.
    Casting a ``[C]`` vector costs a few microseconds (measured: bf16 [5120] -> fp32 about
    3-9 us on the project CPU), against 0.7 ms for a bf16 [2048, 1536] LayerNorm.
    """
    w = None if weight is None else weight.float()
    b = None if bias is None else bias.float()
    return w, b


def check_layer_norm_input(x: torch.Tensor, normalized_shape: tuple[int, ...], op: str) -> None:
    """TypeError for a non-float tensor, ValueError for trailing dims not matching."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: expected a tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(
            f"{op}: input dtype {x.dtype} is not a floating point type; "
            "expected float32, bfloat16 or float16"
        )
    k = len(normalized_shape)
    if x.dim() < k or tuple(x.shape[x.dim() - k :]) != tuple(normalized_shape):
        raise ValueError(
            f"{op}: input of shape {tuple(x.shape)} does not end in normalized_shape "
            f"{tuple(normalized_shape)}; expected trailing dims {tuple(normalized_shape)}, "
            f"got {tuple(x.shape[max(0, x.dim() - k) :])}"
        )


@register_op("fp32_layer_norm")
class FP32LayerNorm(nn.LayerNorm, CustomOp):
    """LayerNorm computed in fp32 and returned in the input's dtype.

    Takes ``nn.LayerNorm``'s constructor arguments and state dict (``weight``/``bias``),
    is an ``nn.LayerNorm``, and loads the state dicts of ``nn.LayerNorm`` and of
    diffusers' ``FP32LayerNorm``. Use :meth:`from_module` to convert an existing norm
    while keeping its parameters.
    """

    def __init__(
        self,
        normalized_shape: int | list[int] | tuple[int, ...] | torch.Size,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)

    @classmethod
    def from_module(cls, module: nn.LayerNorm) -> FP32LayerNorm:
        """An FP32LayerNorm sharing ``module``'s parameters (no copy) and settings."""
        if not isinstance(module, nn.LayerNorm):
            raise TypeError(f"from_module expects an nn.LayerNorm, got {type(module).__name__}")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.normalized_shape = tuple(module.normalized_shape)
        new.eps = module.eps
        new.elementwise_affine = module.elementwise_affine
        new.weight = module.weight
        new.bias = module.bias
        new.train(module.training)
        return new

    def _params32(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return fp32_params(self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        check_layer_norm_input(x, self.normalized_shape, "FP32LayerNorm")
        return self.dispatch(x)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self._params32()
        return F.layer_norm(x.float(), self.normalized_shape, w, b, self.eps).to(x.dtype)

    @fast_path(precisions=("exact", "fast"), dtypes=_FLOATS, inference_only=True)
    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        from ditops.kernels.cpu.layer_norm import fp32_layer_norm

        w, b = self._params32()
        exact = self.resolved_precision() == "exact"
        return fp32_layer_norm(x, list(self.normalized_shape), w, b, self.eps, exact)

    @fast_path(backend=TRITON, precisions=("fast",), dtypes=_FLOATS, inference_only=True)
    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        from ditops.kernels.triton.layer_norm import fp32_layer_norm

        n = 1
        for d in self.normalized_shape:
            n *= d
        # The kernel normalises the last dim; collapse a multi-dim normalized_shape into it.
        rows = x.reshape(*x.shape[: x.dim() - len(self.normalized_shape)], n)
        w = None if self.weight is None else self.weight.reshape(n)
        b = None if self.bias is None else self.bias.reshape(n)
        return fp32_layer_norm(rows, w, b, self.eps).reshape(x.shape)

    forward_hip = forward_cuda
    forward_xpu = forward_cuda

    def fast_path_reasons(self, kind: str, *args: Any, **kwargs: Any) -> list[str]:
        if kind == "npu" and args[0].dim() > _NPU_MAX_DIMS:
            dims = args[0].dim()
            return [f"{dims}-D input: the NPU layer norm takes at most {_NPU_MAX_DIMS} dims"]
        return []

    @fast_path(backend=NPU_LAYER_NORM, precisions=("fast",), dtypes=_FLOATS, inference_only=True)
    def forward_npu(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self._params32()
        return NPU_LAYER_NORM.layer_norm(x, self.normalized_shape, w, b, self.eps).to(x.dtype)
