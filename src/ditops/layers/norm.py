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

import threading
import weakref
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


class Fp32ParamCache:
    """fp32 copies of a module's parameters, made once and reused.

    An entry is keyed by the parameter object (weakly), its ``data_ptr``, ``_version``,
    device and dtype, so in-place updates, ``.to()`` and ``load_state_dict`` refresh it.
    A parameter that already is fp32 is returned as it is (no copy). While grad is
    enabled and the parameter requires it, the cache is bypassed so gradients reach
    the parameter. Entries are plain attributes, never part of the state dict.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[Any, tuple[Any, ...], torch.Tensor]] = {}

    def get(self, name: str, param: torch.Tensor | None) -> torch.Tensor | None:
        if param is None:
            return None
        if param.dtype == torch.float32:
            return param
        if torch.compiler.is_compiling():
            # A compiled graph casts once per call inside the graph; no Python-side state.
            return param.float()
        if (torch.is_grad_enabled() and param.requires_grad) or param.is_inference():
            # inference tensors have no version counter to key on.
            return param.float()
        key = (param.data_ptr(), param._version, param.device, param.dtype)
        entry = self._entries.get(name)
        if entry is not None and entry[0]() is param and entry[1] == key:
            return entry[2]
        copy = param.detach().float()
        with self._lock:
            self._entries[name] = (weakref.ref(param), key, copy)
        return copy

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


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
        self._fp32 = Fp32ParamCache()

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
        new._fp32 = Fp32ParamCache()
        new.train(module.training)
        return new

    def _params32(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self._fp32.get("weight", self.weight), self._fp32.get("bias", self.bias)

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
