"""Wan's modulation chain, in fp32 and rounded once: LayerNorm with scale/shift, the gated
residual, and both fused.

In a DiT block the norm never comes alone. Wan computes::

    norm_h = (norm1(h.float()) * (1 + scale) + shift).type_as(h)   # before attention
    h = (h.float() + attn_out * gate).type_as(h)                     # after it

FLUX and HunyuanVideo have the same chain around an ``nn.LayerNorm`` in the model dtype
(these ops normalise in fp32, so for them the result is the more precise one, not
their bits; :mod:`ditops.ops.modulation_model_dtype` has their chain). Three ops, each
with the literal fp32 expression as its meaning (``forward_native``):

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
:mod:`ditops.ops.modulation_args`): activations ``[B, L, C]`` or ``[L, C]``;
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

The modules users put in models, calling these ops, are
:class:`~ditops.layers.modulation.LayerNormScaleShift` and
:class:`~ditops.layers.modulation.ScaleResidualLayerNormScaleShift`.
"""

from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F

from ditops.backends.npu import NPU_LAYER_NORM
from ditops.backends.triton import TRITON
from ditops.core.checks import FLOATS, check_eps
from ditops.core.op import CustomOp, register_op
from ditops.core.paths import path
from ditops.core.public import public_op
from ditops.ops import modulation_args as args
from ditops.ops.modulation_args import ModulationArg, ModulationCall

#: nn.LayerNorm's
DEFAULT_EPS = 1e-5


def _no_gate(gate: ModulationArg) -> bool:
    """None or the number 1: ``x * 1`` is ``x`` bit for bit, so there is nothing to do."""
    return gate is None or (
        isinstance(gate, numbers.Number) and not isinstance(gate, bool) and gate == 1
    )


def prepare_fp32(
    op: str,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    gate: ModulationArg = None,
    scale: ModulationArg = None,
    shift: ModulationArg = None,
    eps: object = DEFAULT_EPS,
    out_dtype: torch.dtype | None = None,
) -> ModulationCall:
    """Check one call of Wan's chain (TypeError/ValueError naming what is wrong) and
    normalise it into its record."""
    x3, res3, shape = args.prepare_activations(op, x, residual)
    model = x3
    if res3 is not None:
        if x3.dtype not in (res3.dtype, torch.float32):
            raise TypeError(
                f"{op}: x has dtype {x3.dtype}; expected the residual's dtype {res3.dtype} "
                "or float32"
            )
        model = res3
    args.check_param(weight, model, op, "weight")
    args.check_param(bias, model, op, "bias")
    args.check_out_dtype(out_dtype, op)
    eps_f = check_eps(op, eps)
    out = out_dtype or model.dtype
    gated = None
    if res3 is not None:
        gated = (None if _no_gate(gate) else gate, (torch.float32, model.dtype))
    norm = (scale, shift, (torch.float32, model.dtype, out))
    g, s, t, groups = args.check_modulations(op, model, gated, norm)
    return ModulationCall(x3, res3, g, s, t, groups, eps_f, shape, weight, bias, out)


# --- the meaning: the literal eager expressions ---------------------------------------------


def _native_gated(c: ModulationCall) -> torch.Tensor:
    assert c.residual is not None
    r4, g4 = c.grouped(c.residual, "gate")
    x4, _ = c.grouped(c.x, "gate")
    prod = x4 if c.gate.is_none else x4 * g4
    return (r4.float() + prod).to(c.residual.dtype).reshape(c.residual.shape)


def _native_norm(c: ModulationCall, h3: torch.Tensor) -> torch.Tensor:
    h4, s4 = c.grouped(h3, "scale")
    _, t4 = c.grouped(h3, "shift")
    y = F.layer_norm(h4.float(), (h3.shape[-1],), _f32(c.weight), _f32(c.bias), c.eps)
    if not c.scale.is_none:
        y = y * (1 + s4)
    if not c.shift.is_none:
        y = y + t4
    return y.to(c.out_dtype).reshape(h3.shape)


def _f32(p: torch.Tensor | None) -> torch.Tensor | None:
    return None if p is None else p.float()


# --- what the paths refuse, and the NPU's modulated norm --------------------------------------


def _triton_reasons(c: ModulationCall) -> list[str]:
    """What the Triton kernels cannot reproduce: a scalar gate rounded as a scalar.

    Eager computes ``bf16_x * 0.5`` (a Python number or an fp32 0-d tensor) in bf16 with
    the scalar's fp32 value; the kernels round ``x * gate`` to the promoted dtype of the
    two tensors, which would be fp32 there.
    """
    if not c.gate.is_scalar or c.x.dtype == torch.float32:
        return []
    value = c.gate.value
    value_dtype = value.dtype if isinstance(value, torch.Tensor) else torch.float32
    if torch.promote_types(c.x.dtype, value_dtype) != torch.result_type(c.x, value):  # type: ignore[arg-type]
        return ["a scalar gate whose product with low-precision x eager rounds to x's dtype"]
    return []


def _npu_reasons(c: ModulationCall) -> list[str]:
    reasons = []
    if any(m.groups == c.x.shape[1] and m.groups > 1 for m in c.mods().values()):
        reasons.append(
            "per-token modulation: the NPU path folds it into the norm's affine parameters, "
            "which needs one row per sample or per frame"
        )
    if c.model.dtype != c.out_dtype:
        reasons.append("out_dtype differs from the normalised tensor's dtype")
    return reasons


def _npu_norm(c: ModulationCall, h3: torch.Tensor) -> torch.Tensor:
    """The modulated norm of ``h3`` on the NPU: one NPU layer norm per sample or frame,
    with ``(1 + scale)`` and ``shift`` folded into its fp32 weight and bias."""
    B, L, C = h3.shape
    dev = h3.device
    scale = args.modulation_rows(c.scale, h3, torch.float32)
    shift = args.modulation_rows(c.shift, h3, torch.float32)
    # One affine per (sample, group): [Bm, G, C] (G = 1 or F), folded in fp32.
    w_all = (torch.ones(C, device=dev) if c.weight is None else c.weight.float()).expand(1, 1, C)
    b_all = (torch.zeros(C, device=dev) if c.bias is None else c.bias.float()).expand(1, 1, C)
    if scale is not None:
        s1 = (1 + scale).float()  # 1 + scale in scale's dtype, as eager rounds it
        w_all = w_all * s1
        b_all = b_all * s1
    if shift is not None:
        b_all = b_all + shift.float()
    layer_norm = NPU_LAYER_NORM.layer_norm
    if w_all.shape[:2] == (1, 1) and b_all.shape[:2] == (1, 1):
        w1, b1 = w_all.reshape(C).contiguous(), b_all.reshape(C).contiguous()
        return layer_norm(h3, [C], w1, b1, c.eps).to(c.out_dtype)
    G = max(w_all.shape[1], b_all.shape[1])
    seg = L // G
    out = torch.empty((B, L, C), dtype=c.out_dtype, device=dev)
    for i in range(B):
        for g in range(G):
            wi = w_all[min(i, w_all.shape[0] - 1), min(g, w_all.shape[1] - 1)].contiguous()
            bi = b_all[min(i, b_all.shape[0] - 1), min(g, b_all.shape[1] - 1)].contiguous()
            rows = slice(g * seg, (g + 1) * seg)
            y = layer_norm(h3[i, rows].contiguous(), [C], wi, bi, c.eps)
            out[i, rows].copy_(y)
    return out


# --- the ops ----------------------------------------------------------------------------------


@register_op("layer_norm_scale_shift")
class LayerNormScaleShiftOp(CustomOp):
    """``(LN_fp32(x) * (1 + scale) + shift).to(out_dtype)``; see the module docstring."""

    def prepare(  # type: ignore[override]
        self,
        x: torch.Tensor,
        weight: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        scale: ModulationArg = None,
        shift: ModulationArg = None,
        eps: float = DEFAULT_EPS,
        out_dtype: torch.dtype | None = None,
    ) -> ModulationCall:
        op = "layer_norm_scale_shift"
        return prepare_fp32(op, x, None, weight, bias, None, scale, shift, eps, out_dtype)

    def forward_native(self, c: ModulationCall) -> torch.Tensor:
        return _native_norm(c, c.x).reshape(c.shape)

    @path(precisions=("exact", "fast"), dtypes=FLOATS, inference_only=True)
    def forward_cpu(self, c: ModulationCall) -> torch.Tensor:
        from ditops.kernels.cpu.modulation import layer_norm_scale_shift as kernel

        s, t = c.exact_operand("scale"), c.exact_operand("shift")
        w, b = _f32(c.weight), _f32(c.bias)
        return kernel(c.x, w, b, s, t, c.eps, c.out_dtype, c.exact).reshape(c.shape)

    @path(
        "cuda",
        "hip",
        "xpu",
        backend=TRITON,
        dtypes=FLOATS,
        inference_only=True,
        reasons=_triton_reasons,
    )
    def forward_cuda(self, c: ModulationCall) -> torch.Tensor:
        from ditops.kernels.triton.modulation import layer_norm_scale_shift as kernel

        s, t = c.rows_or_zeros("scale", torch.float32), c.rows_or_zeros("shift", torch.float32)
        return kernel(c.x, c.weight, c.bias, s, t, c.eps, c.out_dtype).reshape(c.shape)

    @path(backend=NPU_LAYER_NORM, dtypes=FLOATS, inference_only=True, reasons=_npu_reasons)
    def forward_npu(self, c: ModulationCall) -> torch.Tensor:
        return _npu_norm(c, c.x).reshape(c.shape)


@register_op("gated_residual")
class GatedResidualOp(CustomOp):
    """``(residual.float() + x * gate).to(residual.dtype)``; see the module docstring."""

    def prepare(  # type: ignore[override]
        self, residual: torch.Tensor, x: torch.Tensor, gate: ModulationArg = 1
    ) -> ModulationCall:
        return prepare_fp32("gated_residual", x, residual, gate=gate)

    def forward_native(self, c: ModulationCall) -> torch.Tensor:
        return _native_gated(c).reshape(c.shape)

    @path(precisions=("exact", "fast"), dtypes=FLOATS, inference_only=True)
    def forward_cpu(self, c: ModulationCall) -> torch.Tensor:
        from ditops.kernels.cpu.modulation import gated_residual as kernel

        return kernel(c.residual, c.x, c.exact_operand("gate"), c.exact).reshape(c.shape)

    @path(
        "cuda",
        "hip",
        "xpu",
        backend=TRITON,
        dtypes=FLOATS,
        inference_only=True,
        reasons=_triton_reasons,
    )
    def forward_cuda(self, c: ModulationCall) -> torch.Tensor:
        from ditops.kernels.triton.modulation import gated_residual as kernel

        return kernel(c.residual, c.x, c.rows("gate")).reshape(c.shape)


@register_op("scale_residual_layer_norm_scale_shift")
class ScaleResidualLayerNormScaleShiftOp(CustomOp):
    """The gated residual and the modulated norm of its result; see the module docstring."""

    def prepare(  # type: ignore[override]
        self,
        residual: torch.Tensor,
        x: torch.Tensor,
        gate: ModulationArg = 1,
        weight: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        scale: ModulationArg = None,
        shift: ModulationArg = None,
        eps: float = DEFAULT_EPS,
        out_dtype: torch.dtype | None = None,
    ) -> ModulationCall:
        op = "scale_residual_layer_norm_scale_shift"
        return prepare_fp32(op, x, residual, weight, bias, gate, scale, shift, eps, out_dtype)

    def forward_native(self, c: ModulationCall) -> tuple[torch.Tensor, torch.Tensor]:
        new_res = _native_gated(c)
        return _native_norm(c, new_res).reshape(c.shape), new_res.reshape(c.shape)

    @path(precisions=("exact", "fast"), dtypes=FLOATS, inference_only=True)
    def forward_cpu(self, c: ModulationCall) -> tuple[torch.Tensor, torch.Tensor]:
        from ditops.kernels.cpu.modulation import scale_residual_layer_norm_scale_shift as kernel

        g, s, t = (c.exact_operand(n) for n in ("gate", "scale", "shift"))
        w, b = _f32(c.weight), _f32(c.bias)
        out, new_res = kernel(c.residual, c.x, g, w, b, s, t, c.eps, c.out_dtype, c.exact)
        return out.reshape(c.shape), new_res.reshape(c.shape)

    @path(
        "cuda",
        "hip",
        "xpu",
        backend=TRITON,
        dtypes=FLOATS,
        inference_only=True,
        reasons=_triton_reasons,
    )
    def forward_cuda(self, c: ModulationCall) -> tuple[torch.Tensor, torch.Tensor]:
        from ditops.kernels.triton.modulation import scale_residual_layer_norm_scale_shift as kernel

        g = c.rows("gate")
        s, t = c.rows_or_zeros("scale", torch.float32), c.rows_or_zeros("shift", torch.float32)
        out, new_res = kernel(c.residual, c.x, g, c.weight, c.bias, s, t, c.eps, c.out_dtype)
        return out.reshape(c.shape), new_res.reshape(c.shape)

    @path(backend=NPU_LAYER_NORM, dtypes=FLOATS, inference_only=True, reasons=_npu_reasons)
    def forward_npu(self, c: ModulationCall) -> tuple[torch.Tensor, torch.Tensor]:
        new_res = _native_gated(c)  # no NPU kernel for it: plain torch ops on the NPU
        return _npu_norm(c, new_res).reshape(c.shape), new_res.reshape(c.shape)


@public_op(LayerNormScaleShiftOp())
def layer_norm_scale_shift(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    scale: ModulationArg = None,
    shift: ModulationArg = None,
    eps: float = DEFAULT_EPS,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Wan's modulated norm: a LayerNorm in fp32, scaled and shifted, rounded once.

    Meaning::

        y = F.layer_norm(x.float(), (C,), weight.float(), bias.float(), eps)
        (y * (1 + scale) + shift).to(out_dtype or x.dtype)

    ``scale`` or ``shift`` None leaves that step out; ``1 + scale`` is computed in scale's
    dtype, as eager does.

    Shapes and dtypes:
        x: ``[B, L, C]`` or ``[L, C]``, fp32/bf16/fp16.
        weight, bias: the norm's affine parameters, ``[C]`` (None: no affine).
        scale, shift: a Python number, or a tensor ``[C]``, ``[B, 1, C]``, ``[B, L, C]``
            (Wan2.2 TI2V) or ``[B, F, 1, C]`` (one per frame), fp32 or x's dtype.
        eps: the LayerNorm's epsilon, a positive float.
        out_dtype: the output dtype (None: x's).

    Returns ``[B, L, C]`` (x's shape) in ``out_dtype``.

    Precision: ``exact`` is bitwise the meaning (the CPU path; GPUs run the meaning);
    ``fast`` differs on at most 1e-3 of the elements by at most 1 ulp of the output dtype
    (1e-5 absolute where ``shift`` cancels the product). NaN and inf propagate as in the
    meaning.
    """


@public_op(GatedResidualOp())
def gated_residual(
    residual: torch.Tensor, x: torch.Tensor, gate: ModulationArg = 1
) -> torch.Tensor:
    """Wan's gated residual, in fp32 and rounded once.

    Meaning::

        (residual.float() + x * gate).to(residual.dtype)

    ``gate`` None or the number 1: ``residual.float() + x``.

    Shapes and dtypes:
        residual: ``[B, L, C]`` or ``[L, C]``, fp32/bf16/fp16.
        x: residual's shape, residual's dtype or fp32 (Wan's feed-forward passes fp32).
        gate: a Python number, or a tensor ``[C]``, ``[B, 1, C]``, ``[B, L, C]`` or
            ``[B, F, 1, C]``, fp32 or residual's dtype.

    Returns residual's shape and dtype.

    Precision: every path is bitwise the meaning (``exact`` and ``fast``). NaN and inf
    propagate as in the meaning.
    """


@public_op(ScaleResidualLayerNormScaleShiftOp())
def scale_residual_layer_norm_scale_shift(
    residual: torch.Tensor,
    x: torch.Tensor,
    gate: ModulationArg = 1,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    scale: ModulationArg = None,
    shift: ModulationArg = None,
    eps: float = DEFAULT_EPS,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Wan's gated residual and the modulated norm of its result, in one pass.

    Meaning::

        new_residual = gated_residual(residual, x, gate)
        modulated = layer_norm_scale_shift(new_residual, weight, bias, scale, shift,
                                           eps, out_dtype)
        return modulated, new_residual

    The norm reads the new residual after its rounding to residual's dtype, as Wan does.

    Shapes and dtypes:
        residual: ``[B, L, C]`` or ``[L, C]``, fp32/bf16/fp16.
        x: residual's shape, residual's dtype or fp32.
        gate, scale, shift: a Python number, or a tensor ``[C]``, ``[B, 1, C]``,
            ``[B, L, C]`` or ``[B, F, 1, C]``, fp32 or residual's dtype (gate None or 1:
            no gating; scale/shift None: that step left out).
        weight, bias: the norm's affine parameters, ``[C]`` (None: no affine).
        eps: the LayerNorm's epsilon, a positive float.
        out_dtype: the modulated output's dtype (None: residual's).

    Returns ``(modulated, new_residual)``, both residual's shape.

    Precision: the new residual is bitwise the meaning on every path; the modulated output
    as :func:`layer_norm_scale_shift` (``exact`` bitwise, ``fast`` within 1 ulp on at most
    1e-3 of the elements). NaN and inf propagate as in the meaning.
    """
