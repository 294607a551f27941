"""Triton kernels for DiT modulation: LayerNorm with scale/shift, and the gated residual.

Inputs: activations ``x`` (and ``residual``) of shape ``[B, L, C]`` with any row strides;
modulation tensors (``scale``, ``shift``, ``gate``) already brought by the caller to
``[Bm, G, C]`` with Bm in {1, B} and G dividing L: token l of batch b reads row
``(b if Bm > 1 else 0, l // (L // G))``. Any strides, 0 included (broadcast scalars);
fp32 or low-precision modulation. Everything is computed in fp32 and rounded once per
output, with eager PyTorch's intermediate roundings reproduced:

* ``1 + scale`` is rounded to scale's dtype (eager adds in that dtype);
* ``x * gate`` is rounded to ``promote_types(x.dtype, gate.dtype)`` before the fp32
  addition to ``residual.float()``;
* the fused op normalises the new residual *after* rounding it to the residual's dtype,
  as Wan does (``h = (h.float() + y * g).type_as(h)`` then ``norm(h.float())``).

The LayerNorm itself is the kernel in ``layer_norm.py`` (one kernel; this module
switches on its prologue and epilogue) and shares its numerics and its rounding
decision: fp32 -> bf16 rounds to nearest even by integer arithmetic, the same on GPUs
and in the interpreter, and no multiply-add is contracted into an FMA. Hence
``gated_residual`` is bitwise equal to eager (tests assert it under the interpreter);
the normalised outputs are within 1 ulp of the output dtype (different fp32
summation order in the statistics), so they are "fast"-precision paths.

Bandwidth model (bytes per element of ``[B, L, C]``; a = activation size, m = modulation
size; a per-token modulation ``[B, L, C]`` costs m per element, a ``[B, 1, C]`` or
``[B, F, 1, C]`` one costs ~0, being re-read from cache):

* ``layer_norm_scale_shift``: read x, write out: ``2a`` (+ ``2m`` per-token scale and
  shift). bf16 with [B, 1, C] fp32 modulation: 4 B; with [B, L, C] fp32: 12 B.
* ``gated_residual``: read residual and x, write the new residual: ``3a`` (+ ``m``).
* ``scale_residual_layer_norm_scale_shift``: read residual and x, write the modulated
  output and the new residual: ``4a`` (+ ``3m`` per-token gate, scale and shift).
  bf16 with [B, 1, C] fp32 modulation: 8 B; with [B, L, C] fp32: 20 B.

All in one pass over memory; rows wider than ``layer_norm.MAX_FUSED_C`` read their
inputs twice. The eager chains these replace make five or six fp32 passes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ditops.kernels.opaque import opaque_op
from ditops.kernels.triton.layer_norm import launch_layer_norm
from ditops.kernels.triton.rows import (
    SUPPORTED_DTYPES,
    check_affine,
    check_float,
    gated_sum,
    modulation_args,
    modulation_rows,
    new_output,
    round_rne,
    split_rows,
    tl_dtype,
)

# Elements per program of the element-wise gated residual.
_RESIDUAL_TILE = 4096


@triton.jit
def _gated_residual_kernel(
    R,
    X,
    G,
    Out,
    M,
    L,
    C,
    r_sb,
    r_sl,
    x_sb,
    x_sl,
    g_sb,
    g_sg,
    g_t,
    g_sc,
    HAS_GATE: tl.constexpr,
    PROD_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """``(residual.float() + x * gate).to(residual.dtype)`` over BLOCK_M rows of [B, L, C]."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    b, tok = split_rows(rows, L)
    r_off = b * r_sb + tok * r_sl
    x_off = b * x_sb + tok * x_sl
    g_off = modulation_rows(b, tok, g_t, g_sb, g_sg)
    o_off = rows.to(tl.int64) * C
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = rmask[:, None] & (cols < C)[None, :]
        h = gated_sum(R, X, G, r_off, x_off, g_off, cols, g_sc, mask, HAS_GATE, PROD_DTYPE)
        tl.store(
            Out + o_off[:, None] + cols[None, :], round_rne(h, Out.dtype.element_ty), mask=mask
        )


# ----------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------


def _check_activation(name: str, t: Tensor) -> None:
    check_float(name, t, t.device)
    if t.dim() != 3:
        raise ValueError(f"{name} must be 3-D [B, L, C]; got shape {tuple(t.shape)}")


def _check_modulation(name: str, m: Tensor, x: Tensor) -> None:
    """``m`` must be [Bm, G, C'] with Bm in {1, B}, G >= 1 dividing L, C' in {1, C}."""
    check_float(name, m, x.device)
    b, length, c = x.shape
    ok = m.dim() == 3
    if ok:
        bm, g, cm = m.shape
        ok = bm in (1, b) and g >= 1 and length % g == 0 and cm in (1, c)
    if not ok:
        raise ValueError(
            f"{name} has shape {tuple(m.shape)}; expected [Bm, G, C] with Bm in (1, {b}), "
            f"G dividing L={length} and C in (1, {c}) (the caller reshapes [C], [B, 1, C], "
            f"[B, L, C] and [B, F, 1, C] modulations to this form)"
        )


def _check_out_dtype(out_dtype: torch.dtype | None) -> None:
    if out_dtype is not None and out_dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"out_dtype is {out_dtype}; expected one of float32, bfloat16, float16")


def _check_residual_pair(residual: Tensor, x: Tensor, gate: Tensor | None) -> None:
    _check_activation("residual", residual)
    _check_activation("x", x)
    if residual.shape != x.shape:
        raise ValueError(
            f"x has shape {tuple(x.shape)}; expected the residual's shape {tuple(residual.shape)}"
        )
    if x.device != residual.device:
        raise ValueError(f"x is on {x.device}; expected the residual's device {residual.device}")
    if gate is not None:
        _check_modulation("gate", gate, residual)


def _check_norm_args(
    h: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    scale: Tensor,
    shift: Tensor,
    out_dtype: torch.dtype | None,
) -> None:
    """The norm's arguments for the (already checked) activations ``h`` it normalises."""
    check_affine(weight, bias, h.shape[-1], h.device)
    _check_modulation("scale", scale, h)
    _check_modulation("shift", shift, h)
    _check_out_dtype(out_dtype)


# ----------------------------------------------------------------------------------------
# Launchers wrapped as custom ops (opaque to torch.compile)
# ----------------------------------------------------------------------------------------


@opaque_op("ditops::triton_layer_norm_scale_shift")
def _layer_norm_scale_shift_op(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    scale: Tensor,
    shift: Tensor,
    eps: float,
    out_dtype: torch.dtype | None,
) -> Tensor:
    out = new_output(x, out_dtype)
    launch_layer_norm(x, out, weight, bias, eps, scale=scale, shift=shift)
    return out


_layer_norm_scale_shift_op.register_fake(lambda x, w, b, sc, sh, eps, dt: new_output(x, dt))


def _launch_gated_residual(residual: Tensor, x: Tensor, gate: Tensor | None, out: Tensor) -> None:
    bsz, length, c = residual.shape
    n_rows = bsz * length
    if n_rows == 0 or c == 0:
        return
    if residual.stride(-1) != 1:
        residual = residual.contiguous()
    if x.stride(-1) != 1:
        x = x.contiguous()
    prod_dtype = tl.float32
    if gate is not None:
        prod_dtype = tl_dtype(torch.promote_types(x.dtype, gate.dtype))
    block_c = min(triton.next_power_of_2(c), _RESIDUAL_TILE)
    block_m = min(_RESIDUAL_TILE // block_c, triton.next_power_of_2(n_rows))
    num_warps = min(8, max(1, block_m * block_c // 512))
    _gated_residual_kernel[(triton.cdiv(n_rows, block_m),)](
        residual,
        x,
        gate if gate is not None else x,
        out,
        n_rows,
        length,
        c,
        residual.stride(0),
        residual.stride(1),
        x.stride(0),
        x.stride(1),
        *modulation_args(gate, length),
        HAS_GATE=gate is not None,
        PROD_DTYPE=prod_dtype,
        BLOCK_M=block_m,
        BLOCK_C=block_c,
        num_warps=num_warps,
        enable_fp_fusion=False,
    )


@opaque_op("ditops::triton_gated_residual")
def _gated_residual_op(residual: Tensor, x: Tensor, gate: Tensor | None) -> Tensor:
    out = new_output(residual)
    _launch_gated_residual(residual, x, gate, out)
    return out


_gated_residual_op.register_fake(lambda residual, x, gate: new_output(residual))


@opaque_op("ditops::triton_scale_residual_layer_norm_scale_shift")
def _scale_residual_layer_norm_scale_shift_op(
    residual: Tensor,
    x: Tensor,
    gate: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    scale: Tensor,
    shift: Tensor,
    eps: float,
    out_dtype: torch.dtype | None,
) -> tuple[Tensor, Tensor]:
    out, new_residual = new_output(residual, out_dtype), new_output(residual)
    launch_layer_norm(
        x,
        out,
        weight,
        bias,
        eps,
        residual=residual,
        gate=gate,
        new_residual=new_residual,
        scale=scale,
        shift=shift,
    )
    return out, new_residual


_scale_residual_layer_norm_scale_shift_op.register_fake(
    lambda residual, x, gate, w, b, sc, sh, eps, dt: (
        new_output(residual, dt),
        new_output(residual),
    )
)


# ----------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------


def layer_norm_scale_shift(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    scale: Tensor,
    shift: Tensor,
    eps: float,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """``(F.layer_norm(x.float(), (C,), w, b, eps) * (1 + scale) + shift).to(out_dtype)``.

    ``x`` is [B, L, C]; ``scale`` and ``shift`` are [Bm, G, C] (see the module
    docstring); ``1 + scale`` is rounded to scale's dtype as in eager; weight and bias
    (fp32 or low precision, used as fp32) are optional. ``out_dtype`` defaults to x's.
    """
    _check_activation("x", x)
    _check_norm_args(x, weight, bias, scale, shift, out_dtype)
    return _layer_norm_scale_shift_op(x, weight, bias, scale, shift, float(eps), out_dtype)


def gated_residual(residual: Tensor, x: Tensor, gate: Tensor | None) -> Tensor:
    """``(residual.float() + x * gate).to(residual.dtype)``; ``gate=None`` means no gating.

    ``x * gate`` is rounded to their promoted dtype first, as eager does. Bitwise equal
    to the eager expression. Shapes: residual and x [B, L, C], gate [Bm, G, C].
    """
    _check_residual_pair(residual, x, gate)
    return _gated_residual_op(residual, x, gate)


def scale_residual_layer_norm_scale_shift(
    residual: Tensor,
    x: Tensor,
    gate: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    scale: Tensor,
    shift: Tensor,
    eps: float,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """``gated_residual`` then ``layer_norm_scale_shift`` of its result, in one pass.

    Returns ``(modulated, new_residual)`` where ``new_residual = gated_residual(residual,
    x, gate)`` (residual's dtype) and ``modulated = layer_norm_scale_shift(new_residual,
    weight, bias, scale, shift, eps, out_dtype)``: the norm sees the residual already
    rounded to its dtype, as in Wan. ``out_dtype`` defaults to the residual's dtype.
    """
    _check_residual_pair(residual, x, gate)
    _check_norm_args(residual, weight, bias, scale, shift, out_dtype)
    return _scale_residual_layer_norm_scale_shift_op(
        residual, x, gate, weight, bias, scale, shift, float(eps), out_dtype
    )
