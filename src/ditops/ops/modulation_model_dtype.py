"""The modulation chain in the model's own dtype: adaLN-Zero of FLUX, SD3 and HunyuanVideo.

FLUX's blocks (diffusers' ``AdaLayerNormZero``, ``FluxTransformerBlock``) compute, with
every tensor in the model dtype (bf16, fp16 or fp32)::

    n = norm(h) * (1 + scale) + shift        # norm: nn.LayerNorm without affine
    h = h + gate * attn(n)                   # gated residual

and each eager operation rounds to that dtype. This is not the meaning of
:mod:`ditops.ops.modulation_fp32` (Wan's chain: the norm and the modulation in fp32,
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

Shapes are those of :mod:`ditops.ops.modulation_args`: activations ``[B, L, C]`` or
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

import torch
import torch.nn.functional as F

from ditops.backends.triton import TRITON
from ditops.core.checks import FLOATS, check_eps, dtype_name
from ditops.core.op import CustomOp, register_op
from ditops.core.paths import path
from ditops.core.public import public_op
from ditops.ops import modulation_args as args
from ditops.ops.modulation_args import ModulationArg, ModulationCall

#: FLUX's and HunyuanVideo's AdaLayerNormZero
DEFAULT_EPS = 1e-6


def prepare_model_dtype(
    op: str,
    x: object,
    residual: object = None,
    gate: ModulationArg = None,
    scale: ModulationArg = None,
    shift: ModulationArg = None,
    eps: object = DEFAULT_EPS,
    *,
    gated: bool,
    modulated: bool,
) -> ModulationCall:
    """Check one call of this chain (TypeError/ValueError naming what is wrong) and
    normalise it into its record. ``gated``/``modulated``: the op takes a gate / a scale
    and shift."""
    x3, res3, shape = args.prepare_activations(op, x, residual)
    model = x3 if res3 is None else res3
    dtypes = (torch.float32, model.dtype, x3.dtype)
    g, s, t, groups = args.check_modulations(
        op, model, (gate, dtypes) if gated else None, (scale, shift, dtypes) if modulated else None
    )
    return ModulationCall(x3, res3, g, s, t, groups, check_eps(op, eps), shape)


# --- the meaning: the literal eager expressions ---------------------------------------------


def _native_residual(c: ModulationCall) -> torch.Tensor:
    assert c.residual is not None
    r4, g4 = c.grouped(c.residual, "gate")
    x4, _ = c.grouped(c.x, "gate")
    prod = x4 if c.gate.is_none else g4 * x4
    return (r4 + prod).reshape(c.residual.shape)


def _native_modulate(c: ModulationCall, h3: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """The eager expression; ``in_place``: its product and sum written into the norm's
    output (same operands, same order, same dtype with one dtype throughout: eager's bits
    in one buffer instead of three)."""
    h4, s4 = c.grouped(h3, "scale")
    _, t4 = c.grouped(h3, "shift")
    y = F.layer_norm(h4, (h3.shape[-1],), None, None, c.eps)
    if not c.scale.is_none:
        y = y.mul_(1 + s4) if in_place else y * (1 + s4)
    if not c.shift.is_none:
        y = y.add_(t4) if in_place else y + t4
    return y.reshape(h3.shape)


def _whole_residual(c: ModulationCall) -> torch.Tensor:
    """``residual + gate * x`` with the product written into the output and the residual
    added in place: the meaning's operands and order (eager's bits), no temporary."""
    assert c.residual is not None
    r4, g4 = c.grouped(c.residual, "gate")
    x4, _ = c.grouped(c.x, "gate")
    out = torch.empty(r4.shape, dtype=c.residual.dtype, device=r4.device)
    if c.gate.is_none:
        return torch.add(r4, x4, out=out).reshape(c.residual.shape)
    torch.mul(g4, x4, out=out)
    return torch.add(r4, out, out=out).reshape(c.residual.shape)


# --- which calls the fast paths take ----------------------------------------------------------


def one_dtype_reasons(c: ModulationCall) -> list[str]:
    """The fast paths (CPU and Triton) compute in one dtype: every tensor in it,
    modulations as tensors."""
    dtype = c.model.dtype
    reasons = []
    if c.x.dtype != dtype:
        reasons.append(
            f"x is {dtype_name(c.x.dtype)} and the residual {dtype_name(dtype)}: eager "
            "promotes, the fast paths take one dtype"
        )
    for name, mod in c.mods().items():
        value = mod.value
        if value is None:
            continue
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            reasons.append(
                f"{name} is a scalar: eager promotes it as a scalar; running the meaning"
            )
        elif value.dtype != dtype:
            reasons.append(
                f"{name} is {dtype_name(value.dtype)} with {dtype_name(dtype)} activations: "
                "eager promotes the result; the fast paths take one dtype"
            )
    return reasons


def _zeros_or_rows(c: ModulationCall, name: str) -> torch.Tensor:
    return c.rows_or_zeros(name, c.model.dtype)


# --- the ops ------------------------------------------------------------------------------------


@register_op("adaln_modulate")
class AdaLNModulateOp(CustomOp):
    """``F.layer_norm(x) * (1 + scale) + shift`` in x's dtype; see the module docstring."""

    def prepare(  # type: ignore[override]
        self,
        x: torch.Tensor,
        scale: ModulationArg = None,
        shift: ModulationArg = None,
        eps: float = DEFAULT_EPS,
    ) -> ModulationCall:
        return prepare_model_dtype(
            "adaln_modulate", x, None, None, scale, shift, eps, gated=False, modulated=True
        )

    def forward_native(self, c: ModulationCall) -> torch.Tensor:
        return _native_modulate(c, c.x).reshape(c.shape)

    @path(
        precisions=("exact", "fast"), dtypes=FLOATS, inference_only=True,
        propagates_non_finite=True, reasons=one_dtype_reasons,
    )  # fmt: skip
    def forward_cpu(self, c: ModulationCall) -> torch.Tensor:
        from ditops.kernels.cpu.adaln import modulate as kernel

        return kernel(c.x, c.rows("scale"), c.rows("shift"), c.eps, c.exact).reshape(c.shape)

    @path(
        "cpu", precisions=("exact", "fast"), dtypes=FLOATS, inference_only=True,
        propagates_non_finite=True, reasons=one_dtype_reasons, fast_bits="native",
    )  # fmt: skip
    def forward_cpu_whole(self, c: ModulationCall) -> torch.Tensor:
        # The meaning over the whole tensor on every intra-op thread, its product and sum
        # in place (eager's bits, one buffer instead of three). For the tuner: on a quiet
        # 2-core EPYC at FLUX's size the meaning's best calls (memory recycled, both
        # threads) ran at 1.9x the blocked one-thread kernel's
        # (benchmarks/cpu/busy_neighbour-all-ops.txt).
        return _native_modulate(c, c.x, in_place=True).reshape(c.shape)

    @path(
        "cuda", "hip", "xpu", backend=TRITON, dtypes=FLOATS, inference_only=True,
        propagates_non_finite=True, reasons=one_dtype_reasons,
    )  # fmt: skip
    def forward_cuda(self, c: ModulationCall) -> torch.Tensor:
        from ditops.kernels.triton.modulation import layer_norm_scale_shift as kernel

        s, t = _zeros_or_rows(c, "scale"), _zeros_or_rows(c, "shift")
        return kernel(c.x, None, None, s, t, c.eps).reshape(c.shape)


@register_op("adaln_residual")
class AdaLNResidualOp(CustomOp):
    """``residual + gate * x`` in the residual's dtype; see the module docstring."""

    def prepare(  # type: ignore[override]
        self, residual: torch.Tensor, x: torch.Tensor, gate: ModulationArg = None
    ) -> ModulationCall:
        return prepare_model_dtype("adaln_residual", x, residual, gate, gated=True, modulated=False)

    def forward_native(self, c: ModulationCall) -> torch.Tensor:
        return _native_residual(c).reshape(c.shape)

    @path(
        precisions=("exact", "fast"), dtypes=FLOATS, inference_only=True,
        propagates_non_finite=True, reasons=one_dtype_reasons,
        fast_bits="native",  # the kernel gives eager's bits in both precisions
    )  # fmt: skip
    def forward_cpu(self, c: ModulationCall) -> torch.Tensor:
        from ditops.kernels.cpu.adaln import residual as kernel

        return kernel(c.residual, c.x, c.rows("gate")).reshape(c.shape)

    @path(
        "cpu", precisions=("exact", "fast"), dtypes=FLOATS, inference_only=True,
        propagates_non_finite=True, reasons=one_dtype_reasons, fast_bits="native",
    )  # fmt: skip
    def forward_cpu_whole(self, c: ModulationCall) -> torch.Tensor:
        # The meaning's two ATen calls over the whole tensor, the product written into the
        # output and the residual added in place (same operands, same order: eager's
        # bits): no full-size temporary, every intra-op thread. For the tuner: on a quiet
        # 2-core EPYC at FLUX's size it ran at the meaning's speed where the blocked
        # one-thread kernel ran at 0.65x (benchmarks/cpu/flux_ops.txt).
        return _whole_residual(c).reshape(c.shape)

    @path(
        "cuda", "hip", "xpu", backend=TRITON, dtypes=FLOATS, inference_only=True,
        propagates_non_finite=True, reasons=one_dtype_reasons,
    )  # fmt: skip
    def forward_cuda(self, c: ModulationCall) -> torch.Tensor:
        # Wan's gated-residual kernel rounds ``x * gate`` to their dtype before the fp32
        # sum: with one dtype throughout that is eager's ``residual + gate * x``.
        from ditops.kernels.triton.modulation import gated_residual as kernel

        return kernel(c.residual, c.x, c.rows("gate")).reshape(c.shape)


@register_op("adaln_residual_modulate")
class AdaLNResidualModulateOp(CustomOp):
    """The gated residual and the modulated norm of its result; see the module docstring."""

    def prepare(  # type: ignore[override]
        self,
        residual: torch.Tensor,
        x: torch.Tensor,
        gate: ModulationArg = None,
        scale: ModulationArg = None,
        shift: ModulationArg = None,
        eps: float = DEFAULT_EPS,
    ) -> ModulationCall:
        op = "adaln_residual_modulate"
        return prepare_model_dtype(
            op, x, residual, gate, scale, shift, eps, gated=True, modulated=True
        )

    def forward_native(self, c: ModulationCall) -> tuple[torch.Tensor, torch.Tensor]:
        new_res = _native_residual(c)
        return _native_modulate(c, new_res).reshape(c.shape), new_res.reshape(c.shape)

    @path(
        precisions=("exact", "fast"), dtypes=FLOATS, inference_only=True,
        propagates_non_finite=True, reasons=one_dtype_reasons,
    )  # fmt: skip
    def forward_cpu(self, c: ModulationCall) -> tuple[torch.Tensor, torch.Tensor]:
        from ditops.kernels.cpu.adaln import residual_modulate as kernel

        g, s, t = c.rows("gate"), c.rows("scale"), c.rows("shift")
        out, new_res = kernel(c.residual, c.x, g, s, t, c.eps, c.exact)
        return out.reshape(c.shape), new_res.reshape(c.shape)

    @path(
        "cpu", precisions=("exact", "fast"), dtypes=FLOATS, inference_only=True,
        propagates_non_finite=True, reasons=one_dtype_reasons, fast_bits="native",
    )  # fmt: skip
    def forward_cpu_whole(self, c: ModulationCall) -> tuple[torch.Tensor, torch.Tensor]:
        # Both meanings over the whole tensor, products and sums in place (eager's bits):
        # where the blocked kernel loses (quiet, FLUX's size: 0.85x the meaning) this
        # keeps the meaning's speed with two buffers instead of five.
        new_res = _whole_residual(c)
        return _native_modulate(c, new_res, in_place=True).reshape(c.shape), new_res.reshape(
            c.shape
        )

    @path(
        "cuda", "hip", "xpu", backend=TRITON, dtypes=FLOATS, inference_only=True,
        propagates_non_finite=True, reasons=one_dtype_reasons,
    )  # fmt: skip
    def forward_cuda(self, c: ModulationCall) -> tuple[torch.Tensor, torch.Tensor]:
        from ditops.kernels.triton.modulation import scale_residual_layer_norm_scale_shift as k

        g = c.rows("gate")
        s, t = _zeros_or_rows(c, "scale"), _zeros_or_rows(c, "shift")
        out, new_res = k(c.residual, c.x, g, None, None, s, t, c.eps)
        return out.reshape(c.shape), new_res.reshape(c.shape)


@public_op(AdaLNModulateOp())
def adaln_modulate(
    x: torch.Tensor,
    scale: ModulationArg = None,
    shift: ModulationArg = None,
    eps: float = DEFAULT_EPS,
) -> torch.Tensor:
    """adaLN-Zero's modulated norm in the model dtype (FLUX, SD3, HunyuanVideo).

    Meaning, every step rounded to the model dtype as eager rounds it::

        F.layer_norm(x, (C,), None, None, eps) * (1 + scale) + shift

    ``scale`` or ``shift`` None leaves that step out.

    Shapes and dtypes:
        x: ``[B, L, C]`` or ``[L, C]``, fp32/bf16/fp16.
        scale, shift: a Python number, or a tensor ``[C]``, ``[B, 1, C]`` (FLUX),
            ``[B, L, C]`` or ``[B, F, 1, C]``, fp32 or x's dtype (PyTorch's promotion kept).
        eps: the LayerNorm's epsilon, a positive float.

    Returns x's shape, in the promoted dtype of the expression (x's when all share it).

    Precision: ``exact`` is bitwise the meaning (the CPU path; GPUs run the meaning);
    ``fast`` computes in fp32 and rounds once: about a third of bf16 elements differ, each
    by at most 1.5 ulps of ``|LN(x) * (1 + scale)|`` plus 1 ulp of the output. Fast paths
    take one dtype throughout and tensor modulations; other calls run the meaning. NaN and
    inf propagate as in the meaning.
    """


@public_op(AdaLNResidualOp())
def adaln_residual(
    residual: torch.Tensor, x: torch.Tensor, gate: ModulationArg = None
) -> torch.Tensor:
    """adaLN-Zero's gated residual in the model dtype.

    Meaning::

        residual + gate * x      # the product rounded to the dtype, then the sum

    ``gate`` None: ``residual + x``.

    Shapes and dtypes:
        residual: ``[B, L, C]`` or ``[L, C]``, fp32/bf16/fp16.
        x: residual's shape and dtype.
        gate: a Python number, or a tensor ``[C]``, ``[B, 1, C]``, ``[B, L, C]`` or
            ``[B, F, 1, C]``, fp32 or residual's dtype.

    Returns residual's shape, in the expression's promoted dtype.

    Precision: every path is bitwise the meaning (``exact`` and ``fast``). NaN and inf
    propagate as in the meaning.
    """


@public_op(AdaLNResidualModulateOp())
def adaln_residual_modulate(
    residual: torch.Tensor,
    x: torch.Tensor,
    gate: ModulationArg = None,
    scale: ModulationArg = None,
    shift: ModulationArg = None,
    eps: float = DEFAULT_EPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """adaLN-Zero's gated residual and the modulated norm of its result, in one walk
    (FLUX's double-stream blocks between attention and the feed-forward).

    Meaning::

        new_residual = adaln_residual(residual, x, gate)
        return adaln_modulate(new_residual, scale, shift, eps), new_residual

    Shapes and dtypes:
        residual: ``[B, L, C]`` or ``[L, C]``, fp32/bf16/fp16.
        x: residual's shape and dtype.
        gate, scale, shift: a Python number, or a tensor ``[C]``, ``[B, 1, C]``,
            ``[B, L, C]`` or ``[B, F, 1, C]``, fp32 or residual's dtype (None: that step
            left out).
        eps: the LayerNorm's epsilon, a positive float.

    Returns ``(modulated, new_residual)``, both residual's shape.

    Precision: the new residual is bitwise the meaning on every path; the modulated output
    as :func:`adaln_modulate`. NaN and inf propagate as in the meaning.
    """
