"""adaLN-Zero in the model's own dtype: the modulation chain of FLUX, SD3 and HunyuanVideo.

FLUX's blocks (diffusers' ``AdaLayerNormZero``, ``FluxTransformerBlock``) compute, with
every tensor in the model dtype (bf16, fp16 or fp32)::

    n = norm(h) * (1 + scale) + shift        # norm: nn.LayerNorm without affine
    h = h + gate * attn(n)                   # gated residual

and each eager operation rounds to that dtype. This is not the meaning of
:mod:`ditops.layers.modulation` (Wan's chain: the norm and the modulation in fp32,
rounded once), so these ops have their own. Three ops, each with the literal eager
expression as its meaning (``forward_native``), PyTorch's type promotion included:

* ``adaln_modulate(x, scale, shift, eps)``: ``F.layer_norm(x, (C,), None, None, eps) *
  (1 + scale) + shift``. With one dtype throughout, step by step: the LayerNorm reads x,
  computes its statistics in fp32 (ATen's kernel for bf16/fp16 input) and rounds the
  normalised value to x's dtype; ``1 + scale`` is rounded to scale's dtype; the product
  is computed in fp32 and rounded to the dtype; so is the sum with ``shift``.
* ``adaln_residual(residual, x, gate)``: ``residual + gate * x``: the product rounded to
  the dtype, then the sum (computed in fp32 by ATen for bf16/fp16) rounded again.
  ``gate`` None: ``residual + x``.
* ``adaln_residual_modulate(residual, x, gate, scale, shift, eps)``: both, the norm
  reading the new residual: returns ``(modulated, new_residual)`` (FLUX's double-stream
  blocks between attention and the feed-forward).

FLUX's fp16 clipping (``h.clip(-65504, 65504)`` after some residual adds) is not part of
these ops: the FLUX integration applies it where FLUX does.

Shapes are those of :mod:`ditops.kernels.modulation_shapes`: activations ``[B, L, C]`` or
``[L, C]``; modulations a scalar, ``[C]``, ``[B, 1, C]`` (FLUX), ``[B, L, C]`` or
``[B, F, 1, C]``, in fp32 or the model dtype.

Precision (``tests/precision.py`` holds the paths to it):

* ``exact``: bitwise equal to ``forward_native``: the CPU path runs the eager operations
  on row blocks; GPUs run native.
* ``fast``: the residuals (``adaln_residual`` and the new residual of the fused op) are
  bitwise equal to native on the CPU and Triton paths. The modulated output is computed
  in fp32 from x and rounded once, where eager rounds three times (the normalised
  value, the product, the sum): about a third of the bf16 elements differ from native,
  each by at most 1.5 ulps of ``|LN(x) * (1 + scale)|`` plus 1 ulp of the output, in the
  model dtype (where ``shift`` cancels the product the output is tiny and the bound is
  set by the product). fp32 outputs take the exact path on CPU; on Triton they are
  within 1e-5 of that scale.

The fast paths take calls whose tensors all have one dtype (fp32, bf16 or fp16) and
whose modulations are tensors; anything else (a promotion to fp32, a Python-number
scale) runs the meaning. NaN and inf propagate as in the meaning.

Paths: ``cpu`` (exact and fast, :mod:`ditops.kernels.cpu.adaln`), ``cuda``/``hip``/
``xpu`` through Triton (fast; the kernels of :mod:`ditops.kernels.triton.modulation`,
whose gated residual rounds the product to the model dtype as eager does and whose
modulated norm is computed in fp32 and rounded once), otherwise native.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from ditops.backends.triton import TRITON
from ditops.custom_op import CustomOp, fast_path, register_op
from ditops.kernels import modulation_shapes as shapes
from ditops.kernels.modulation_shapes import Modulation, ModulationArg

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_DEFAULT_EPS = 1e-6  # FLUX's and HunyuanVideo's AdaLayerNormZero


class _Call(NamedTuple):
    """A validated call: [B, L, C] views and the modulations, checked once."""

    shape: torch.Size
    x3: torch.Tensor
    res3: torch.Tensor | None
    mods: dict[str, Modulation]
    groups: int
    eps: float


def _check_eps(eps: object, op: str) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"{op}: eps must be a real number, got {type(eps).__name__}")
    return float(eps)


def _prepare(
    op: str,
    x: object,
    residual: object = None,
    gate: ModulationArg = None,
    scale: ModulationArg = None,
    shift: ModulationArg = None,
    eps: object = _DEFAULT_EPS,
) -> _Call:
    """Validate one call (TypeError/ValueError naming what is wrong) and normalise it."""
    x3 = shapes.rows3(x, op, "x")
    res3 = None
    model = x3
    shape = x.shape  # type: ignore[attr-defined]
    if residual is not None:
        res3 = shapes.rows3(residual, op, "residual")
        if res3.shape != x3.shape:
            raise ValueError(
                f"{op}: x has shape {list(x3.shape)}; expected the residual's shape "
                f"{list(res3.shape)}"
            )
        if x3.device != res3.device:
            raise ValueError(
                f"{op}: x is on {x3.device}; expected the residual's device {res3.device}"
            )
        model = res3
        shape = residual.shape  # type: ignore[attr-defined]
    dtypes = (torch.float32, model.dtype, x3.dtype)
    mods: dict[str, Modulation] = {}
    if residual is not None:
        mods["gate"] = shapes.check_modulation(gate, model, op, "gate", dtypes)
    if op != "adaln_residual":
        mods["scale"] = shapes.check_modulation(scale, model, op, "scale", dtypes)
        mods["shift"] = shapes.check_modulation(shift, model, op, "shift", dtypes)
    groups = shapes.common_groups(op, mods, model.shape[1])
    return _Call(shape, x3, res3, mods, groups, _check_eps(eps, op))


# --- the meaning: the literal eager expressions ---------------------------------------------


def _native_residual(call: _Call) -> torch.Tensor:
    assert call.res3 is not None
    gate = call.mods["gate"]
    r4, g4 = shapes.grouped_view(call.res3, call.groups, gate)
    x4, _ = shapes.grouped_view(call.x3, call.groups, gate)
    prod = x4 if gate.is_none else g4 * x4
    out = r4 + prod
    return out.reshape(call.res3.shape)


def _native_modulate(call: _Call, h3: torch.Tensor) -> torch.Tensor:
    scale, shift = call.mods["scale"], call.mods["shift"]
    h4, s4 = shapes.grouped_view(h3, call.groups, scale)
    _, t4 = shapes.grouped_view(h3, call.groups, shift)
    y = F.layer_norm(h4, (h3.shape[-1],), None, None, call.eps)
    if not scale.is_none:
        y = y * (1 + s4)
    if not shift.is_none:
        y = y + t4
    return y.reshape(h3.shape)


# --- which calls the fast paths take ----------------------------------------------------------


def _fast_reasons(call: _Call) -> list[str]:
    """The fast paths compute in one dtype: every tensor in it, modulations as tensors."""
    dtype = (call.res3 if call.res3 is not None else call.x3).dtype
    reasons = []
    if call.x3.dtype != dtype:
        reasons.append(
            f"x is {_name(call.x3.dtype)} and the residual {_name(dtype)}: eager promotes, "
            "the fast paths take one dtype"
        )
    for name, mod in call.mods.items():
        value = mod.value
        if value is None:
            continue
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            reasons.append(
                f"{name} is a scalar: eager promotes it as a scalar; running the meaning"
            )
        elif value.dtype != dtype:
            reasons.append(
                f"{name} is {_name(value.dtype)} with {_name(dtype)} activations: eager promotes "
                "the result; the fast paths take one dtype"
            )
    return reasons


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _rows(call: _Call, name: str) -> torch.Tensor | None:
    """A modulation as the ``[Bm, G, C]`` view the kernels take (None when absent)."""
    return shapes.modulation_rows(call.mods[name], call.x3)


def _triton_rows(call: _Call, name: str) -> torch.Tensor:
    """As :func:`_rows`, zeros when absent (``1 + 0`` and ``+ 0`` change nothing, and the
    Triton LayerNorm epilogue takes both or neither)."""
    rows = _rows(call, name)
    if rows is None:
        dtype = (call.res3 if call.res3 is not None else call.x3).dtype
        return torch.zeros((1, 1, 1), dtype=dtype, device=call.x3.device)
    return rows


# --- the ops ------------------------------------------------------------------------------------


class _AdaLNOp(CustomOp):
    """Shared plumbing: one validation per call, handed to the path as ``call``."""

    def _validate(self, *args: Any) -> _Call:
        raise NotImplementedError

    def _call(self, *args: Any, call: _Call | None = None) -> _Call:
        return call if call is not None else self._validate(*args)

    def fast_path_reasons(self, kind: str, *args: Any, **kwargs: Any) -> list[str]:
        if kind in ("cpu", "cuda", "hip", "xpu"):
            return _fast_reasons(self._call(*args, **kwargs))
        return []

    def _exact(self) -> bool:
        return self.resolved_precision() == "exact"


@register_op("adaln_modulate")
class AdaLNModulateOp(_AdaLNOp):
    """``F.layer_norm(x) * (1 + scale) + shift`` in x's dtype; see the module docstring."""

    def forward(  # type: ignore[override]
        self,
        x: torch.Tensor,
        scale: ModulationArg = None,
        shift: ModulationArg = None,
        eps: float = _DEFAULT_EPS,
    ) -> torch.Tensor:
        call = self._validate(x, scale, shift, eps)
        return self.dispatch(x, scale, shift, call.eps, call=call)

    def _validate(self, *args: Any) -> _Call:
        x, scale, shift, eps = args
        return _prepare("adaln_modulate", x, None, None, scale, shift, eps)

    def forward_native(self, *args: Any, call: _Call | None = None) -> torch.Tensor:
        c = self._call(*args, call=call)
        return _native_modulate(c, c.x3).reshape(c.shape)

    @fast_path(
        precisions=("exact", "fast"), dtypes=_FLOATS, inference_only=True,
        propagates_non_finite=True,
    )  # fmt: skip
    def forward_cpu(self, *args: Any, call: _Call | None = None) -> torch.Tensor:
        from ditops.kernels.cpu.adaln import modulate as kernel

        c = self._call(*args, call=call)
        out = kernel(c.x3, _rows(c, "scale"), _rows(c, "shift"), c.eps, self._exact())
        return out.reshape(c.shape)

    @fast_path(
        backend=TRITON, precisions=("fast",), dtypes=_FLOATS, inference_only=True,
        propagates_non_finite=True,
    )  # fmt: skip
    def forward_cuda(self, *args: Any, call: _Call | None = None) -> torch.Tensor:
        from ditops.kernels.triton.modulation import layer_norm_scale_shift as kernel

        c = self._call(*args, call=call)
        s, t = _triton_rows(c, "scale"), _triton_rows(c, "shift")
        return kernel(c.x3, None, None, s, t, c.eps).reshape(c.shape)

    forward_hip = forward_cuda
    forward_xpu = forward_cuda


@register_op("adaln_residual")
class AdaLNResidualOp(_AdaLNOp):
    """``residual + gate * x`` in the residual's dtype; see the module docstring."""

    def forward(  # type: ignore[override]
        self, residual: torch.Tensor, x: torch.Tensor, gate: ModulationArg = None
    ) -> torch.Tensor:
        call = self._validate(residual, x, gate)
        return self.dispatch(residual, x, gate, call=call)

    def _validate(self, *args: Any) -> _Call:
        residual, x, gate = args
        return _prepare("adaln_residual", x, residual, gate)

    def forward_native(self, *args: Any, call: _Call | None = None) -> torch.Tensor:
        c = self._call(*args, call=call)
        return _native_residual(c).reshape(c.shape)

    @fast_path(
        precisions=("exact", "fast"), dtypes=_FLOATS, inference_only=True,
        propagates_non_finite=True,
    )  # fmt: skip
    def forward_cpu(self, *args: Any, call: _Call | None = None) -> torch.Tensor:
        from ditops.kernels.cpu.adaln import residual as kernel

        c = self._call(*args, call=call)
        assert c.res3 is not None
        return kernel(c.res3, c.x3, _rows(c, "gate")).reshape(c.shape)

    @fast_path(
        backend=TRITON, precisions=("fast",), dtypes=_FLOATS, inference_only=True,
        propagates_non_finite=True,
    )  # fmt: skip
    def forward_cuda(self, *args: Any, call: _Call | None = None) -> torch.Tensor:
        # Wan's gated-residual kernel rounds ``x * gate`` to their dtype before the fp32
        # sum: with one dtype throughout that is eager's ``residual + gate * x``.
        from ditops.kernels.triton.modulation import gated_residual as kernel

        c = self._call(*args, call=call)
        assert c.res3 is not None
        return kernel(c.res3, c.x3, _rows(c, "gate")).reshape(c.shape)

    forward_hip = forward_cuda
    forward_xpu = forward_cuda


@register_op("adaln_residual_modulate")
class AdaLNResidualModulateOp(_AdaLNOp):
    """The gated residual and the modulated norm of its result; see the module docstring."""

    def forward(  # type: ignore[override]
        self,
        residual: torch.Tensor,
        x: torch.Tensor,
        gate: ModulationArg = None,
        scale: ModulationArg = None,
        shift: ModulationArg = None,
        eps: float = _DEFAULT_EPS,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        call = self._validate(residual, x, gate, scale, shift, eps)
        return self.dispatch(residual, x, gate, scale, shift, call.eps, call=call)

    def _validate(self, *args: Any) -> _Call:
        residual, x, gate, scale, shift, eps = args
        return _prepare("adaln_residual_modulate", x, residual, gate, scale, shift, eps)

    def forward_native(
        self, *args: Any, call: _Call | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        c = self._call(*args, call=call)
        new_res = _native_residual(c)
        return _native_modulate(c, new_res).reshape(c.shape), new_res.reshape(c.shape)

    @fast_path(
        precisions=("exact", "fast"), dtypes=_FLOATS, inference_only=True,
        propagates_non_finite=True,
    )  # fmt: skip
    def forward_cpu(
        self, *args: Any, call: _Call | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from ditops.kernels.cpu.adaln import residual_modulate as kernel

        c = self._call(*args, call=call)
        assert c.res3 is not None
        g, s, t = _rows(c, "gate"), _rows(c, "scale"), _rows(c, "shift")
        out, new_res = kernel(c.res3, c.x3, g, s, t, c.eps, self._exact())
        return out.reshape(c.shape), new_res.reshape(c.shape)

    @fast_path(
        backend=TRITON, precisions=("fast",), dtypes=_FLOATS, inference_only=True,
        propagates_non_finite=True,
    )  # fmt: skip
    def forward_cuda(
        self, *args: Any, call: _Call | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from ditops.kernels.triton.modulation import scale_residual_layer_norm_scale_shift as k

        c = self._call(*args, call=call)
        assert c.res3 is not None
        g = _rows(c, "gate")
        s, t = _triton_rows(c, "scale"), _triton_rows(c, "shift")
        out, new_res = k(c.res3, c.x3, g, None, None, s, t, c.eps)
        return out.reshape(c.shape), new_res.reshape(c.shape)

    forward_hip = forward_cuda
    forward_xpu = forward_cuda


#: ``adaln_modulate(x, scale=None, shift=None, eps=1e-6)``
adaln_modulate = AdaLNModulateOp()
#: ``adaln_residual(residual, x, gate=None)``
adaln_residual = AdaLNResidualOp()
#: ``adaln_residual_modulate(residual, x, gate=None, scale=None, shift=None, eps=1e-6)
#: -> (modulated, new_residual)``
adaln_residual_modulate = AdaLNResidualModulateOp()
