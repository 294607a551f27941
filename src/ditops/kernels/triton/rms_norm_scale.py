"""``rms_norm_scale`` on GPUs: diffusers' RMSNorm, the scale and the shift in one pass.

A program holds ``BLOCK_R`` rows of ``x`` ``[B, L, C]`` in fp32 registers; the sum of
squares, the normalisation, the weight, the scale and the shift are computed there, each
rounded (``round_rne``) where eager rounds (:mod:`ditops.ops.rms_norm_scale`; every such
rounding is to the norm's dtype, see :func:`ditops.kernels.cpu.rms_norm_scale.out_dtypes`),
the result rounded once to the output dtype. The statistics are summed in another order
than ATen's (and a GPU may contract the product and the shift into a multiply-add):
a ``fast`` path. Modulation rows are read through strides (0 for a shared dim).
Bandwidth: one read of x, one write of the output; the modulations come from cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ditops.kernels.cpu.rms_norm_scale import out_dtypes
from ditops.kernels.opaque import opaque_op
from ditops.kernels.qk_norm_rope_tables import LOW_PRECISION
from ditops.kernels.triton.rows import round_rne, split_rows

#: Target elements of one tile: narrow rows share a program.
TILE_ELEMENTS = 4096


@triton.jit
def _rms_scale_kernel(
    X, W, S, SH, R, Out,
    n_rows, L, N, eps, inv_n,
    s_sb, s_sl, h_sb, h_sl,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_W: tl.constexpr, ROUND_BEFORE_W: tl.constexpr, ROUND_NORM: tl.constexpr,
    ROUND_PROD: tl.constexpr, HAS_SHIFT: tl.constexpr, ROUND_SUM: tl.constexpr,
):  # fmt: skip
    """``BLOCK_R`` rows of contiguous ``X`` [B * L, N]; ``R``'s dtype is the roundings'."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    b, pos = split_rows(tl.where(rmask, rows, 0), L)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    mask = rmask[:, None] & cmask[None, :]
    off = rows.to(tl.int64)[:, None] * N + cols[None, :]
    x = tl.load(X + off, mask=mask, other=0.0).to(tl.float32)
    ss = tl.sum(x * x, axis=1)
    y = x * tl.math.div_rn(1.0, tl.sqrt_rn(ss * inv_n + eps))[:, None]
    if HAS_W:
        if ROUND_BEFORE_W:
            y = round_rne(y, R.dtype.element_ty).to(tl.float32)
        y = y * tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    if ROUND_NORM:
        y = round_rne(y, R.dtype.element_ty).to(tl.float32)
    s = tl.load(S + (b * s_sb + pos * s_sl)[:, None] + cols[None, :], mask=mask, other=0.0)
    y = y * s.to(tl.float32)
    if ROUND_PROD:
        y = round_rne(y, R.dtype.element_ty).to(tl.float32)
    if HAS_SHIFT:
        h = tl.load(SH + (b * h_sb + pos * h_sl)[:, None] + cols[None, :], mask=mask, other=0.0)
        y = y + h.to(tl.float32)
        if ROUND_SUM:
            y = round_rne(y, R.dtype.element_ty).to(tl.float32)
    tl.store(Out + off, round_rne(y, Out.dtype.element_ty), mask=mask)


def _rows3(m: Tensor) -> tuple[Tensor, int, int]:
    """A ``[C]`` / ``[Bm, G, C]`` modulation with a unit last stride, and its row strides
    (0 where the dim is shared)."""
    m3 = m.view(1, 1, -1) if m.dim() == 1 else m
    if m3.stride(-1) != 1:
        m3 = m3.contiguous()
    sb = m3.stride(0) if m3.shape[0] > 1 else 0
    sl = m3.stride(1) if m3.shape[1] > 1 else 0
    return m3, sb, sl


@opaque_op("ditops::triton_rms_norm_scale")
def rms_norm_scale(
    x: Tensor,
    scale: Tensor,
    shift: Tensor | None,
    weight: Tensor | None,
    eps: float,
    upcast: bool,
) -> Tensor:
    """``rms(x) * scale (+ shift)`` of ``x`` ``[B, L, C]``, eager's roundings, fp32 sums."""
    B, L, C = x.shape
    nd, pd, sd, od = out_dtypes(x, scale, shift, weight, upcast)
    out = torch.empty((B, L, C), dtype=od, device=x.device)
    if out.numel() == 0:
        return out
    x = x.contiguous()
    s3, s_sb, s_sl = _rows3(scale)
    h3, h_sb, h_sl = _rows3(shift) if shift is not None else (s3, 0, 0)
    low = nd in LOW_PRECISION
    r = torch.empty(1, dtype=nd if low else torch.float32, device=x.device)
    n_rows = B * L
    block_n = triton.next_power_of_2(C)
    block_r = max(1, min(TILE_ELEMENTS // block_n, triton.next_power_of_2(n_rows)))
    _rms_scale_kernel[(triton.cdiv(n_rows, block_r),)](
        x, weight if weight is not None else x, s3, h3, r, out,
        n_rows, L, C, eps, 1.0 / C,
        s_sb, s_sl, h_sb, h_sl,
        BLOCK_R=block_r, BLOCK_N=block_n,
        HAS_W=weight is not None,
        ROUND_BEFORE_W=weight is not None and weight.dtype in LOW_PRECISION,
        ROUND_NORM=low, ROUND_PROD=low and pd in LOW_PRECISION,
        HAS_SHIFT=shift is not None, ROUND_SUM=low and sd in LOW_PRECISION,
        num_warps=min(16, max(4, block_r * block_n // 1024)),
    )  # fmt: skip
    return out


@rms_norm_scale.register_fake
def _(x, scale, shift, weight, eps, upcast):
    od = out_dtypes(x, scale, shift, weight, upcast)[3]
    return torch.empty(x.shape, dtype=od, device=x.device)
