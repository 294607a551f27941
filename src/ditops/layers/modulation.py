"""DiT modulation: LayerNorm with scale/shift, the gated residual, and both fused.

In a DiT block the norm never comes alone. Wan computes::

    norm_h = (norm1(h.float()) * (1 + scale) + shift).type_as(h)   # before attention
    h = (h.float() + attn_out * gate).type_as(h)                     # after it

FLUX and HunyuanVideo have the same chain around an ``nn.LayerNorm`` in the model dtype
(these ops normalise in fp32, so for them the result is the more precise one, not
their bits). Three ops, each with the literal fp32 expression as its meaning
(``forward_native``):

* ``layer_norm_scale_shift(x, weight, bias, scale, shift, eps, out_dtype)``:
  ``(F.layer_norm(x.float(), (C,), w.float(), b.float(), eps) * (1 + scale) + shift)``
  rounded once to ``out_dtype`` (default: x's dtype).
* ``gated_residual(residual, x, gate)``: ``(residual.float() + x * gate)`` rounded once
  to the residual's dtype. ``gate`` None or the number 1: no gating. ``x`` has the
  residual's dtype or fp32 (Wan's FFN residual passes ``ff_output.float()``).
* ``scale_residual_layer_norm_scale_shift(residual, x, gate, weight, bias, scale,
  shift, eps, out_dtype)``: both, the norm reading the new residual after its rounding
  (as Wan does); returns ``(modulated, new_residual)``.

``scale`` or ``shift`` None leaves that step out. Shapes (see
:mod:`ditops.kernels.modulation_shapes`): activations ``[B, L, C]`` or ``[L, C]``;
modulations a scalar, ``[C]``, ``[B, 1, C]``, ``[B, L, C]`` or ``[B, F, 1, C]``, in fp32
or the model dtype. Every promotion of the eager expression is kept: ``1 + scale`` is
computed in scale's dtype, ``x * gate`` in their promoted dtype (a Python-number gate
keeps a bf16 ``x * gate`` in bf16).

Precision:

* ``exact``: bitwise equal to ``forward_native`` (the CPU path; GPUs run native).
* ``fast``: the gated residual is exact on the CPU and Triton paths. The normalised
  output differs from native on at most 1e-3 of the elements, by at most 1 ulp of the
  output dtype, or, where ``shift`` nearly cancels ``LN(x) * (1 + scale)`` so that the
  result is tiny, by at most 1e-5 absolute (a few fp32 roundings of terms of order 1;
  the bound scales with ``|LN(x) * (1 + scale)| + |shift|``). An fp32 output on CPU takes
  the exact path.

Paths: ``cpu`` (exact and fast, :mod:`ditops.kernels.cpu.modulation`), ``cuda``/
``hip``/``xpu`` through Triton (:mod:`ditops.kernels.triton.modulation`, fast),
``npu`` through the NPU layer norm (:class:`ditops.backends.npu.NpuLayerNorm`: the legacy
``attentions.layernorm``, else ``F.layer_norm`` run by torch_npu) with the modulation
folded into its fp32 affine parameters (fast; per-sample and per-frame modulation),
otherwise native.

The modules :class:`LayerNormScaleShift` and :class:`ScaleResidualLayerNormScaleShift`
hold a norm's ``weight``/``bias`` under the same state-dict keys as ``nn.LayerNorm``
(and diffusers' ``FP32LayerNorm``), so they replace such a norm in a loaded model;
``from_module(norm)`` converts one keeping its parameters.
"""

from __future__ import annotations

import numbers
from typing import Any, ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ditops.backends.npu import NPU_LAYER_NORM
from ditops.backends.triton import TRITON
from ditops.custom_op import CustomOp, fast_path, register_op
from ditops.kernels import modulation_shapes as shapes
from ditops.kernels.modulation_shapes import Modulation, ModulationArg

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_DEFAULT_EPS = 1e-5  # nn.LayerNorm's


class _Call(NamedTuple):
    """A validated call: the arguments, [B, L, C] views, modulations and their row count."""

    shape: torch.Size  # of the activations: every output takes it
    x3: torch.Tensor
    res3: torch.Tensor | None
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    mods: dict[str, Modulation]
    groups: int
    eps: float
    out_dtype: torch.dtype


def _no_gate(gate: ModulationArg) -> bool:
    """None or the number 1: ``x * 1`` is ``x`` bit for bit, so there is nothing to do."""
    return gate is None or (
        isinstance(gate, numbers.Number) and not isinstance(gate, bool) and gate == 1
    )


def _check_precision(precision: object) -> None:
    if precision not in (None, "exact", "fast"):
        raise ValueError(f"precision must be None, 'exact' or 'fast', got {precision!r}")


def _check_eps(eps: object, op: str) -> float:
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"{op}: eps must be a real number, got {type(eps).__name__}")
    return float(eps)


def _prepare(
    op: str,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    gate: ModulationArg = None,
    scale: ModulationArg = None,
    shift: ModulationArg = None,
    eps: object = _DEFAULT_EPS,
    out_dtype: torch.dtype | None = None,
) -> _Call:
    """Validate one call (TypeError/ValueError naming what is wrong) and normalise it."""
    x3 = shapes.rows3(x, op, "x")
    res3 = None
    model = x3
    if residual is not None:
        res3 = shapes.rows3(residual, op, "residual")
        if tuple(residual.shape) != tuple(x.shape):
            raise ValueError(
                f"{op}: x has shape {tuple(x.shape)}; expected the residual's shape "
                f"{tuple(residual.shape)}"
            )
        if x.device != residual.device:
            raise ValueError(
                f"{op}: x is on {x.device}; expected the residual's device {residual.device}"
            )
        if x.dtype not in (residual.dtype, torch.float32):
            raise TypeError(
                f"{op}: x has dtype {x.dtype}; expected the residual's dtype {residual.dtype} "
                "or float32"
            )
        model = res3
    shapes.check_param(weight, model, op, "weight")
    shapes.check_param(bias, model, op, "bias")
    shapes.check_out_dtype(out_dtype, op)
    eps_f = _check_eps(eps, op)
    out = out_dtype or model.dtype
    mods: dict[str, Modulation] = {}
    if residual is not None:
        g = None if _no_gate(gate) else gate
        mods["gate"] = shapes.check_modulation(g, model, op, "gate", (torch.float32, model.dtype))
    norm_dtypes = (torch.float32, model.dtype, out)
    mods["scale"] = shapes.check_modulation(scale, model, op, "scale", norm_dtypes)
    mods["shift"] = shapes.check_modulation(shift, model, op, "shift", norm_dtypes)
    groups = shapes.common_groups(op, mods, model.shape[1])
    return _Call(
        (residual if residual is not None else x).shape,
        x3,
        res3,
        weight,
        bias,
        mods,
        groups,
        eps_f,
        out,
    )


# --- native: the literal eager expressions ------------------------------------------------


def _native_gated(call: _Call) -> torch.Tensor:
    assert call.res3 is not None
    gate = call.mods["gate"]
    r4, g4 = shapes.grouped_view(call.res3, call.groups, gate)
    x4, _ = shapes.grouped_view(call.x3, call.groups, gate)
    prod = x4 if gate.is_none else x4 * g4
    return (r4.float() + prod).to(call.res3.dtype).reshape(call.res3.shape)


def _native_norm(call: _Call, h3: torch.Tensor) -> torch.Tensor:
    scale, shift = call.mods["scale"], call.mods["shift"]
    h4, s4 = shapes.grouped_view(h3, call.groups, scale)
    _, t4 = shapes.grouped_view(h3, call.groups, shift)
    y = F.layer_norm(h4.float(), (h3.shape[-1],), _f32(call.weight), _f32(call.bias), call.eps)
    if not scale.is_none:
        y = y * (1 + s4)
    if not shift.is_none:
        y = y + t4
    return y.to(call.out_dtype).reshape(h3.shape)


# --- shared pieces of the fast paths ------------------------------------------------------


def _f32(p: torch.Tensor | None) -> torch.Tensor | None:
    return None if p is None else p.float()


def _cpu_operands(call: _Call, *names: str) -> list[torch.Tensor | None]:
    return [shapes.exact_operand(call.mods[n], call.x3) for n in names]


def _triton_rows(call: _Call, name: str) -> torch.Tensor:
    """A modulation as [Bm, G, C] for the Triton kernels; zeros when absent (1 + 0 and
    + 0 change no value)."""
    rows = shapes.modulation_rows(call.mods[name], call.x3)
    if rows is None:
        return torch.zeros((1, 1, 1), dtype=torch.float32, device=call.x3.device)
    return rows


def _triton_reasons(call: _Call) -> list[str]:
    """What the Triton kernels cannot reproduce: a scalar gate rounded as a scalar.

    Eager computes ``bf16_x * 0.5`` (a Python number or an fp32 0-d tensor) in bf16 with
    the scalar's fp32 value; the kernels round ``x * gate`` to the promoted dtype of the
    two tensors, which would be fp32 there.
    """
    gate = call.mods.get("gate")
    if gate is None or not gate.is_scalar or call.x3.dtype == torch.float32:
        return []
    value = gate.value
    value_dtype = value.dtype if isinstance(value, torch.Tensor) else torch.float32
    if torch.promote_types(call.x3.dtype, value_dtype) != torch.result_type(call.x3, value):
        return ["a scalar gate whose product with low-precision x eager rounds to x's dtype"]
    return []


def _npu_reasons(call: _Call) -> list[str]:
    reasons = []
    if any(m.groups == call.x3.shape[1] and m.groups > 1 for m in call.mods.values()):
        reasons.append(
            "per-token modulation: the NPU path folds it into the norm's affine parameters, "
            "which needs one row per sample or per frame"
        )
    norm_in = call.res3 if call.res3 is not None else call.x3
    if norm_in.dtype != call.out_dtype:
        reasons.append("out_dtype differs from the normalised tensor's dtype")
    return reasons


def _npu_norm(call: _Call, h3: torch.Tensor) -> torch.Tensor:
    """The modulated norm of ``h3`` on the NPU: one NPU layer norm per sample or frame,
    with ``(1 + scale)`` and ``shift`` folded into its fp32 weight and bias."""
    B, L, C = h3.shape
    dev = h3.device
    scale = shapes.modulation_rows(call.mods["scale"], h3, torch.float32)
    shift = shapes.modulation_rows(call.mods["shift"], h3, torch.float32)
    w = call.weight
    b = call.bias
    # One affine per (sample, group): [Bm, G, C] (G = 1 or F), folded in fp32.
    w_all = (torch.ones(C, device=dev) if w is None else w.float()).expand(1, 1, C)
    b_all = (torch.zeros(C, device=dev) if b is None else b.float()).expand(1, 1, C)
    if scale is not None:
        s1 = (1 + scale).float()  # 1 + scale in scale's dtype, as eager rounds it
        w_all = w_all * s1
        b_all = b_all * s1
    if shift is not None:
        b_all = b_all + shift.float()
    layer_norm = NPU_LAYER_NORM.layer_norm
    eps = call.eps
    if w_all.shape[:2] == (1, 1) and b_all.shape[:2] == (1, 1):
        w1, b1 = w_all.reshape(C).contiguous(), b_all.reshape(C).contiguous()
        return layer_norm(h3, [C], w1, b1, eps).to(call.out_dtype)
    G = max(w_all.shape[1], b_all.shape[1])
    seg = L // G
    out = torch.empty((B, L, C), dtype=call.out_dtype, device=dev)
    for i in range(B):
        for g in range(G):
            wi = w_all[min(i, w_all.shape[0] - 1), min(g, w_all.shape[1] - 1)].contiguous()
            bi = b_all[min(i, b_all.shape[0] - 1), min(g, b_all.shape[1] - 1)].contiguous()
            rows = slice(g * seg, (g + 1) * seg)
            y = layer_norm(h3[i, rows].contiguous(), [C], wi, bi, eps)
            out[i, rows].copy_(y)
    return out


# --- the ops ----------------------------------------------------------------------------


class _ModulationOp(CustomOp):
    """The shared plumbing of the three ops: validation once per call, path reasons."""

    def _validate(self, *args: Any) -> _Call:
        raise NotImplementedError

    def _call(self, *args: Any, call: _Call | None = None) -> _Call:
        """The validated call: ``forward`` hands it to the path it dispatches to (one
        validation per call); a direct call of a path validates its arguments itself."""
        return call if call is not None else self._validate(*args)

    def fast_path_reasons(self, kind: str, *args: Any, **kwargs: Any) -> list[str]:
        if kind == "npu":
            return _npu_reasons(self._call(*args, **kwargs))
        if kind in ("cuda", "hip", "xpu"):
            return _triton_reasons(self._call(*args, **kwargs))
        return []

    def _exact(self) -> bool:
        return self.resolved_precision() == "exact"


@register_op("layer_norm_scale_shift")
class LayerNormScaleShiftOp(_ModulationOp):
    """``(LN_fp32(x) * (1 + scale) + shift).to(out_dtype)``; see the module docstring."""

    def forward(  # type: ignore[override]
        self,
        x: torch.Tensor,
        weight: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        scale: ModulationArg = None,
        shift: ModulationArg = None,
        eps: float = _DEFAULT_EPS,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        call = self._validate(x, weight, bias, scale, shift, eps, out_dtype)
        return self.dispatch(x, weight, bias, scale, shift, call.eps, out_dtype, call=call)

    def _validate(self, *args: Any) -> _Call:
        x, weight, bias, scale, shift, eps, out_dtype = args
        return _prepare(
            "layer_norm_scale_shift", x, None, weight, bias, None, scale, shift, eps, out_dtype
        )

    def forward_native(self, *args: Any, call: _Call | None = None) -> torch.Tensor:
        call = self._call(*args, call=call)
        return _native_norm(call, call.x3).reshape(call.shape)

    @fast_path(precisions=("exact", "fast"), dtypes=_FLOATS, inference_only=True)
    def forward_cpu(self, *args: Any, call: _Call | None = None) -> torch.Tensor:
        from ditops.kernels.cpu.modulation import layer_norm_scale_shift as kernel

        c = self._call(*args, call=call)
        s, t = _cpu_operands(c, "scale", "shift")
        w, b = _f32(c.weight), _f32(c.bias)
        return kernel(c.x3, w, b, s, t, c.eps, c.out_dtype, self._exact()).reshape(c.shape)

    @fast_path(backend=TRITON, precisions=("fast",), dtypes=_FLOATS, inference_only=True)
    def forward_cuda(self, *args: Any, call: _Call | None = None) -> torch.Tensor:
        from ditops.kernels.triton.modulation import layer_norm_scale_shift as kernel

        c = self._call(*args, call=call)
        s, t = _triton_rows(c, "scale"), _triton_rows(c, "shift")
        return kernel(c.x3, c.weight, c.bias, s, t, c.eps, c.out_dtype).reshape(c.shape)

    forward_hip = forward_cuda
    forward_xpu = forward_cuda

    @fast_path(backend=NPU_LAYER_NORM, precisions=("fast",), dtypes=_FLOATS, inference_only=True)
    def forward_npu(self, *args: Any, call: _Call | None = None) -> torch.Tensor:
        call = self._call(*args, call=call)
        return _npu_norm(call, call.x3).reshape(call.shape)


@register_op("gated_residual")
class GatedResidualOp(_ModulationOp):
    """``(residual.float() + x * gate).to(residual.dtype)``; see the module docstring."""

    def forward(  # type: ignore[override]
        self, residual: torch.Tensor, x: torch.Tensor, gate: ModulationArg = 1
    ) -> torch.Tensor:
        call = self._validate(residual, x, gate)
        g = call.mods["gate"].value
        return self.dispatch(residual, x, g, call=call)

    def _validate(self, *args: Any) -> _Call:
        residual, x, gate = args
        return _prepare("gated_residual", x, residual, gate=gate)

    def forward_native(self, *args: Any, call: _Call | None = None) -> torch.Tensor:
        call = self._call(*args, call=call)
        return _native_gated(call).reshape(call.shape)

    @fast_path(precisions=("exact", "fast"), dtypes=_FLOATS, inference_only=True)
    def forward_cpu(self, *args: Any, call: _Call | None = None) -> torch.Tensor:
        from ditops.kernels.cpu.modulation import gated_residual as kernel

        c = self._call(*args, call=call)
        (g,) = _cpu_operands(c, "gate")
        return kernel(c.res3, c.x3, g, self._exact()).reshape(c.shape)

    @fast_path(backend=TRITON, precisions=("fast",), dtypes=_FLOATS, inference_only=True)
    def forward_cuda(self, *args: Any, call: _Call | None = None) -> torch.Tensor:
        from ditops.kernels.triton.modulation import gated_residual as kernel

        c = self._call(*args, call=call)
        g = shapes.modulation_rows(c.mods["gate"], c.x3)
        return kernel(c.res3, c.x3, g).reshape(c.shape)

    forward_hip = forward_cuda
    forward_xpu = forward_cuda


@register_op("scale_residual_layer_norm_scale_shift")
class ScaleResidualLayerNormScaleShiftOp(_ModulationOp):
    """The gated residual and the modulated norm of its result; see the module docstring."""

    def forward(  # type: ignore[override]
        self,
        residual: torch.Tensor,
        x: torch.Tensor,
        gate: ModulationArg = 1,
        weight: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        scale: ModulationArg = None,
        shift: ModulationArg = None,
        eps: float = _DEFAULT_EPS,
        out_dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        call = self._validate(residual, x, gate, weight, bias, scale, shift, eps, out_dtype)
        g = call.mods["gate"].value
        args = (residual, x, g, weight, bias, scale, shift, call.eps, out_dtype)
        return self.dispatch(*args, call=call)

    def _validate(self, *args: Any) -> _Call:
        residual, x, gate, weight, bias, scale, shift, eps, out_dtype = args
        op = "scale_residual_layer_norm_scale_shift"
        return _prepare(op, x, residual, weight, bias, gate, scale, shift, eps, out_dtype)

    def forward_native(
        self, *args: Any, call: _Call | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        call = self._call(*args, call=call)
        new_res = _native_gated(call)
        return _native_norm(call, new_res).reshape(call.shape), new_res.reshape(call.shape)

    @fast_path(precisions=("exact", "fast"), dtypes=_FLOATS, inference_only=True)
    def forward_cpu(
        self, *args: Any, call: _Call | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from ditops.kernels.cpu.modulation import scale_residual_layer_norm_scale_shift as kernel

        c = self._call(*args, call=call)
        g, s, t = _cpu_operands(c, "gate", "scale", "shift")
        w, b = _f32(c.weight), _f32(c.bias)
        out, new_res = kernel(c.res3, c.x3, g, w, b, s, t, c.eps, c.out_dtype, self._exact())
        return out.reshape(c.shape), new_res.reshape(c.shape)

    @fast_path(backend=TRITON, precisions=("fast",), dtypes=_FLOATS, inference_only=True)
    def forward_cuda(
        self, *args: Any, call: _Call | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from ditops.kernels.triton.modulation import scale_residual_layer_norm_scale_shift as kernel

        c = self._call(*args, call=call)
        g = shapes.modulation_rows(c.mods["gate"], c.x3)
        s, t = _triton_rows(c, "scale"), _triton_rows(c, "shift")
        out, new_res = kernel(c.res3, c.x3, g, c.weight, c.bias, s, t, c.eps, c.out_dtype)
        return out.reshape(c.shape), new_res.reshape(c.shape)

    forward_hip = forward_cuda
    forward_xpu = forward_cuda

    @fast_path(backend=NPU_LAYER_NORM, precisions=("fast",), dtypes=_FLOATS, inference_only=True)
    def forward_npu(
        self, *args: Any, call: _Call | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        call = self._call(*args, call=call)
        new_res = _native_gated(call)  # no NPU kernel for it: plain torch ops on the NPU
        return _npu_norm(call, new_res).reshape(call.shape), new_res.reshape(call.shape)


#: ``layer_norm_scale_shift(x, weight, bias, scale, shift, eps=1e-5, out_dtype=None)``
layer_norm_scale_shift = LayerNormScaleShiftOp()
#: ``gated_residual(residual, x, gate=1)``
gated_residual = GatedResidualOp()
#: ``scale_residual_layer_norm_scale_shift(residual, x, gate, weight, bias, scale, shift,
#: eps=1e-5, out_dtype=None) -> (modulated, new_residual)``
scale_residual_layer_norm_scale_shift = ScaleResidualLayerNormScaleShiftOp()


# --- modules that stand in for a norm -----------------------------------------------------


class _NormParams(nn.Module):
    """``nn.LayerNorm``'s parameters and settings, under the same state-dict keys.

    ``precision`` (``"exact"``/``"fast"``/None) overrides the process setting for this
    module; None follows ``DITOPS_PRECISION``.
    """

    op_class: ClassVar[type[_ModulationOp]]

    def __init__(
        self,
        normalized_shape: int | list[int] | tuple[int, ...] | torch.Size,
        eps: float = _DEFAULT_EPS,
        elementwise_affine: bool = True,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        precision: str | None = None,
    ) -> None:
        super().__init__()
        _check_precision(precision)
        shape = (
            (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        )
        if len(shape) != 1:
            raise ValueError(
                f"{type(self).__name__} normalises the last dim only; normalized_shape must be "
                f"one int C, got {shape}"
            )
        self.normalized_shape = shape
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        kw = {"device": device, "dtype": dtype}
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(shape, **kw))
            self.bias = nn.Parameter(torch.zeros(shape, **kw)) if bias else None
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        # The module's own op instance, so ``precision`` is per module.
        self.op = self.op_class()
        self.op.precision = precision

    @classmethod
    def from_module(cls, module: nn.LayerNorm, precision: str | None = None) -> Any:
        """A module sharing ``module``'s parameters (no copy), eps and affine settings.

        Takes ``nn.LayerNorm`` and its subclasses (diffusers' and ditops' FP32LayerNorm).
        """
        if not isinstance(module, nn.LayerNorm):
            raise TypeError(f"from_module expects an nn.LayerNorm, got {type(module).__name__}")
        new = cls(
            module.normalized_shape, module.eps, elementwise_affine=False, precision=precision
        )
        new.elementwise_affine = module.elementwise_affine
        new.weight = module.weight
        new.bias = module.bias
        new.train(module.training)
        return new

    def extra_repr(self) -> str:
        return (
            f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
        )


class LayerNormScaleShift(_NormParams):
    """A LayerNorm in fp32 followed by ``* (1 + scale) + shift``, rounded once.

    Stands in for an ``nn.LayerNorm`` / ``FP32LayerNorm`` (same constructor, same
    ``weight``/``bias`` state-dict keys). ``forward(x, scale, shift, out_dtype=None)``.
    """

    op_class = LayerNormScaleShiftOp

    def forward(
        self,
        x: torch.Tensor,
        scale: ModulationArg = None,
        shift: ModulationArg = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        return self.op(x, self.weight, self.bias, scale, shift, self.eps, out_dtype)


class ScaleResidualLayerNormScaleShift(_NormParams):
    """The gated residual, then the modulated fp32 LayerNorm of its result, in one pass.

    ``forward(residual, x, gate=1, scale=None, shift=None, out_dtype=None)`` returns
    ``(modulated, new_residual)``. Holds the norm's parameters like ``nn.LayerNorm``.
    """

    op_class = ScaleResidualLayerNormScaleShiftOp

    def forward(
        self,
        residual: torch.Tensor,
        x: torch.Tensor,
        gate: ModulationArg = 1,
        scale: ModulationArg = None,
        shift: ModulationArg = None,
        out_dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.op(residual, x, gate, self.weight, self.bias, scale, shift, self.eps, out_dtype)
