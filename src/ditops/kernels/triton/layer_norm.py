"""Triton LayerNorm in fp32 for GPUs (cuda, hip, xpu), with an optional fused modulation.

One kernel, ``_layer_norm_kernel``, normalises rows of ``[B, L, C]`` views in fp32 and
rounds once to the output dtype. Compile-time flags add a prologue (the gated residual
``residual.float() + x * gate``, rounded to the residual's dtype and stored) and an
epilogue (``* (1 + scale) + shift``); ``modulation.py`` builds its ops on them, so the
row statistics, the normalisation and the rounding live in one place.

Numerics
    Statistics are two-pass within registers: the mean, then the sum of squared
    deviations from it (stable for rows with a large mean). Rows wider than
    ``MAX_FUSED_C`` are processed in column chunks whose moments are merged with Chan's
    formula. Divisions and the square root are the correctly rounded ``div_rn`` /
    ``sqrt_rn`` (Triton's ``/`` on GPUs is an approximate division). The result can
    still differ from PyTorch's by a few fp32 ulps (other summation order), so the op
    is a "fast" path: at most 1 ulp of a low-precision output dtype, rarely.
    Launches that compute a gated residual pass ``enable_fp_fusion=False``: a multiply
    followed by an add is then never contracted into an FMA, so the element-wise steps
    round as eager PyTorch does (that is what makes the gated residual bitwise equal to
    eager). A plain or modulated LayerNorm is a "fast" result anyway and keeps FMAs.

Rounding decision
    Triton's interpreter (``TRITON_INTERPRET=1``, used by the CPU tests) truncates on
    fp32 -> bf16 casts, while GPUs round to nearest even. ``round_rne`` therefore rounds
    fp32 to bf16 with integer arithmetic on the bits (NaN kept as is) before the cast
    when the interpreter runs (``EXPLICIT_RNE``, fixed when this module is imported), so
    the tests see the GPU's rounding and can assert bitwise equality wherever the math
    is the same as eager (the gated residual); they allow 1 ulp for normalised outputs.
    On a GPU the plain cast already rounds to nearest even, and the integer sequence
    cost measurably (H200, 32760x5120 bf16: 0.80 -> 0.63 of clone bandwidth in a
    textbook LayerNorm; benchmarks/gpu/ln_experiment.py), so it is compiled out there.
    fp16 casts round to nearest even on both already.

Bandwidth model (``fp32_layer_norm``; ``s_in``/``s_out`` = element sizes in bytes)
    One pass over memory: each element is read once and written once, so
    ``s_in + s_out`` bytes per element (bf16 -> bf16: 4 B, fp32 -> fp32: 8 B); weight
    and bias are ``C`` elements per row block, served from cache. Rows wider than
    ``MAX_FUSED_C`` read the input twice (statistics, then output; the second read
    mostly from L2): ``2 * s_in + s_out``. Compare with a clone of ``x``
    (``2 * s_in`` for same-dtype output): the target is >= 85% of its bandwidth.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ditops import launch
from ditops.kernels.opaque import opaque_op
from ditops.kernels.triton.rows import (
    check_affine,
    check_float,
    gated_sum,
    load_2d,
    modulation_args,
    modulation_rows,
    new_output,
    round_rne,
    row_view,
    split_rows,
    tl_dtype,
)

# Widest row held in registers in one block; wider rows loop over column chunks.
MAX_FUSED_C = 16384
# Column chunk of the looped path.
LOOP_BLOCK_C = 4096
# Target elements per program for narrow rows (several rows per program).
TILE_ELEMENTS = 2048


# ----------------------------------------------------------------------------------------
# The LayerNorm's @triton.jit steps (modulation.py's kernels use them too)
# ----------------------------------------------------------------------------------------


@triton.jit
def _ln_input(
    R, X, G, NewRes, r_off, x_off, g_off, o_off, cols, g_sc, mask,
    HAS_RESIDUAL: tl.constexpr, HAS_GATE: tl.constexpr, PROD_DTYPE: tl.constexpr,
    STORE_RESIDUAL: tl.constexpr,
):  # fmt: skip
    """The fp32 values to normalise: x, or the new residual rounded to its dtype (stored)."""
    if HAS_RESIDUAL:
        h = gated_sum(R, X, G, r_off, x_off, g_off, cols, g_sc, mask, HAS_GATE, PROD_DTYPE)
        h = round_rne(h, NewRes.dtype.element_ty)
        if STORE_RESIDUAL:
            tl.store(NewRes + o_off[:, None] + cols[None, :], h, mask=mask)
        v = h.to(tl.float32)
    else:
        v = load_2d(X, x_off, cols, 1, mask)
    return tl.where(mask, v, 0.0)


@triton.jit
def row_moments(v, mask, n):
    """Mean and sum of squared deviations of each row of ``v`` over ``mask``; n lanes per row."""
    mean = tl.math.div_rn(tl.sum(v, axis=1), n)
    d = tl.where(mask, v - mean[:, None], 0.0)
    return mean, tl.sum(d * d, axis=1)


@triton.jit
def _normalize_store(
    v, mean, rstd, cols, mask, o_off, W, Bias, Scale, Shift, Out,
    sc_off, sc_sc, sh_off, sh_sc, C,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_MOD: tl.constexpr,
):  # fmt: skip
    """Normalise a tile, apply the affine weights and the modulation, round once, store."""
    y = (v - mean[:, None]) * rstd[:, None]
    cmask = cols < C
    if HAS_W:
        y = y * tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    if HAS_B:
        y = y + tl.load(Bias + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    if HAS_MOD:
        # Eager computes 1 + scale in scale's dtype, then multiplies and adds in fp32.
        s = 1.0 + load_2d(Scale, sc_off, cols, sc_sc, mask)
        if Scale.dtype.element_ty != tl.float32:
            s = round_rne(s, Scale.dtype.element_ty).to(tl.float32)
        y = y * s + load_2d(Shift, sh_off, cols, sh_sc, mask)
    tl.store(Out + o_off[:, None] + cols[None, :], round_rne(y, Out.dtype.element_ty), mask=mask)


@triton.jit
def _layer_norm_kernel(
    R, X, G, W, Bias, Scale, Shift, Out, NewRes,
    M, L, C, eps,
    r_sb, r_sl, x_sb, x_sl,
    g_sb, g_sg, g_t, g_sc,
    sc_sb, sc_sg, sc_t, sc_sc,
    sh_sb, sh_sg, sh_t, sh_sc,
    HAS_RESIDUAL: tl.constexpr, HAS_GATE: tl.constexpr, PROD_DTYPE: tl.constexpr,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_MOD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, LOOP: tl.constexpr,
):  # fmt: skip
    """LayerNorm of BLOCK_M rows of a [B, L, C] view, with the optional prologue/epilogue.

    Outputs (Out, NewRes) are contiguous [M, C]; inputs have row strides (b, l) and
    column stride 1; modulation tensors are [Bm, G, C] with any strides.
    """
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    b, tok = split_rows(rows, L)
    x_off = b * x_sb + tok * x_sl
    r_off = b * r_sb + tok * r_sl
    o_off = rows.to(tl.int64) * C
    g_off = modulation_rows(b, tok, g_t, g_sb, g_sg)
    sc_off = modulation_rows(b, tok, sc_t, sc_sb, sc_sg)
    sh_off = modulation_rows(b, tok, sh_t, sh_sb, sh_sg)
    n = tl.cast(C, tl.float32)
    if not LOOP:
        cols = tl.arange(0, BLOCK_C)
        mask = rmask[:, None] & (cols < C)[None, :]
        v = _ln_input(R, X, G, NewRes, r_off, x_off, g_off, o_off, cols, g_sc, mask,
                      HAS_RESIDUAL, HAS_GATE, PROD_DTYPE, True)  # fmt: skip
        mean, m2 = row_moments(v, mask, n)
    else:
        # Pass 1: chunk moments merged with Chan's formula (the new residual is stored
        # here); pass 2 recomputes the chunk's input rather than reading back a store.
        mean = tl.zeros([BLOCK_M], dtype=tl.float32)
        m2 = tl.zeros([BLOCK_M], dtype=tl.float32)
        for c0 in range(0, C, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            mask = rmask[:, None] & (cols < C)[None, :]
            v = _ln_input(R, X, G, NewRes, r_off, x_off, g_off, o_off, cols, g_sc, mask,
                          HAS_RESIDUAL, HAS_GATE, PROD_DTYPE, True)  # fmt: skip
            n_a = tl.cast(c0, tl.float32)
            n_b = tl.minimum(n - n_a, BLOCK_C)
            mean_b, m2_b = row_moments(v, mask, n_b)
            delta = mean_b - mean
            frac = tl.math.div_rn(n_b, n_a + n_b)
            mean = mean + delta * frac
            m2 = m2 + m2_b + delta * delta * (n_a * frac)
    rstd = tl.math.div_rn(1.0, tl.sqrt_rn(tl.math.div_rn(m2, n) + eps))
    if not LOOP:
        _normalize_store(v, mean, rstd, cols, mask, o_off, W, Bias, Scale, Shift, Out,
                         sc_off, sc_sc, sh_off, sh_sc, C, HAS_W, HAS_B, HAS_MOD)  # fmt: skip
    else:
        for c0 in range(0, C, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            mask = rmask[:, None] & (cols < C)[None, :]
            v = _ln_input(R, X, G, NewRes, r_off, x_off, g_off, o_off, cols, g_sc, mask,
                          HAS_RESIDUAL, HAS_GATE, PROD_DTYPE, False)  # fmt: skip
            _normalize_store(v, mean, rstd, cols, mask, o_off, W, Bias, Scale, Shift, Out,
                             sc_off, sc_sc, sh_off, sh_sc, C, HAS_W, HAS_B, HAS_MOD)  # fmt: skip


@triton.jit
def _layer_norm_row_kernel(
    X, W, Bias, Out, L, C, eps, x_sb, x_sl,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """The plain LayerNorm, one row per program with scalar row offsets (1-D tiles).

    Same numerics as ``_layer_norm_kernel`` without prologue or epilogue. The 2-D tile
    form with one row per program reached 0.37-0.51 of copy bandwidth on an H200 where a
    1-D one-row kernel reached 0.76-0.91 (benchmarks/gpu/ln_experiment.py).
    """
    row = tl.program_id(0).to(tl.int64)
    b = row // L
    cols = tl.arange(0, BLOCK_C)
    mask = cols < C
    v = tl.load(X + b * x_sb + (row - b * L) * x_sl + cols, mask=mask, other=0.0).to(tl.float32)
    n = tl.cast(C, tl.float32)
    mean = tl.math.div_rn(tl.sum(v, axis=0), n)
    d = tl.where(mask, v - mean, 0.0)
    rstd = tl.math.div_rn(1.0, tl.sqrt_rn(tl.math.div_rn(tl.sum(d * d, axis=0), n) + eps))
    y = d * rstd
    if HAS_W:
        y = y * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_B:
        y = y + tl.load(Bias + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * C + cols, round_rne(y, Out.dtype.element_ty), mask=mask)


#: Use ``_layer_norm_row_kernel`` for plain LayerNorms of one row per program.
ROW_KERNEL = True


# ----------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------


def _rows_3d(t: Tensor) -> tuple[Tensor, int, int]:
    """``t`` with last stride 1 (copied only if needed), and its two row strides."""
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        t = t.contiguous()
    return t, t.stride(0), t.stride(1)


def launch_config(n_rows: int, c: int, max_block_c: int) -> tuple[int, int, bool, int]:
    """(BLOCK_M, BLOCK_C, LOOP, num_warps) for rows of width ``c``."""
    if c <= max_block_c:
        block_c = triton.next_power_of_2(c)
        block_m = min(max(1, TILE_ELEMENTS // block_c), triton.next_power_of_2(n_rows))
        loop = False
    else:
        block_c, block_m, loop = min(LOOP_BLOCK_C, triton.next_power_of_2(max_block_c)), 1, True
    # Measured on H200 (benchmarks/gpu/ln_experiment.py): 4 warps for tiles up to 4096
    # elements, 8 for 8192; 16 warps lost 15-35% of the bandwidth.
    num_warps = min(16, max(4, block_m * block_c // 1024))
    return block_m, block_c, loop, num_warps


def launch_layer_norm(
    x: Tensor,
    out: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    *,
    residual: Tensor | None = None,
    gate: Tensor | None = None,
    new_residual: Tensor | None = None,
    scale: Tensor | None = None,
    shift: Tensor | None = None,
    max_block_c: int = MAX_FUSED_C,
) -> None:
    """Launch ``_layer_norm_kernel`` (inputs already validated; outputs contiguous).

    Without ``residual``, normalises ``x``; with it, normalises the new residual
    ``residual.float() + x * gate`` rounded to ``new_residual``'s dtype and stores it too.
    ``scale``/``shift`` (both or neither) are [Bm, G, C] and apply ``* (1 + scale) + shift``.
    """
    c = x.shape[-1]
    n_rows = x.numel() // c if c else 0
    if n_rows == 0 or c == 0:
        return
    r_sb = r_sl = 0
    if residual is None and gate is None and scale is None:
        x, length, x_sb, x_sl = row_view(x)
    else:
        # Modulation rows are indexed by (b, l) of the 3-D [B, L, C] input: keep its dims.
        length = x.shape[1]
        x, x_sb, x_sl = _rows_3d(x)
        if residual is not None:
            residual, r_sb, r_sl = _rows_3d(residual)
    prod_dtype = tl.float32 if gate is None else tl_dtype(torch.promote_types(x.dtype, gate.dtype))
    block_m, block_c, loop, num_warps = launch_config(n_rows, c, max_block_c)
    w = weight.contiguous() if weight is not None else None
    b = bias.contiguous() if bias is not None else None
    if ROW_KERNEL and block_m == 1 and not loop and residual is None and scale is None:
        _layer_norm_row_kernel[(n_rows,)](
            x, w if w is not None else x, b if b is not None else x, out,
            length, c, eps, x_sb, x_sl,
            HAS_W=w is not None, HAS_B=b is not None, BLOCK_C=block_c, num_warps=num_warps,
        )  # fmt: skip
        return

    def run(cfg: dict[str, int]) -> None:  # one launch config (tuned: ditops.launch)
        _layer_norm_kernel[(triton.cdiv(n_rows, cfg["BLOCK_M"]),)](
            residual if residual is not None else x, x, gate if gate is not None else x,
            w if w is not None else x, b if b is not None else x,
            scale if scale is not None else x, shift if shift is not None else x,
            out, new_residual if new_residual is not None else out, n_rows, length, c, eps,
            r_sb, r_sl, x_sb, x_sl, *modulation_args(gate, length),
            *modulation_args(scale, length), *modulation_args(shift, length),
            HAS_RESIDUAL=residual is not None, HAS_GATE=gate is not None, PROD_DTYPE=prod_dtype,
            HAS_W=w is not None, HAS_B=b is not None, HAS_MOD=scale is not None, BLOCK_C=block_c,
            LOOP=loop, enable_fp_fusion=residual is None, **cfg)  # fmt: skip

    shape, configs = (n_rows, c, residual is not None, scale is not None), launch.warps_and_rows(
        block_m, num_warps)  # fmt: skip
    launch.launch("triton_layer_norm", x.device, shape, configs, run)


@opaque_op("ditops::triton_fp32_layer_norm")
def _triton_fp32_layer_norm(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float
) -> Tensor:
    out = new_output(x)
    launch_layer_norm(x, out, weight, bias, eps)
    return out


_triton_fp32_layer_norm.register_fake(lambda x, weight, bias, eps: new_output(x))


def fp32_layer_norm(
    x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5
) -> Tensor:
    """LayerNorm over the last dim computed in fp32 and rounded once to ``x.dtype``.

    Means ``F.layer_norm(x.float(), (C,), weight.float(), bias.float(), eps).to(x.dtype)``
    (weight and bias optional, fp32 or low precision). Any rank >= 1 and any strides;
    the output is contiguous. Precision: "fast" (see the module docstring).
    """
    check_float("x", x, x.device)
    if x.dim() == 0:
        raise ValueError("x must have at least one dim (the normalised one); got a scalar")
    check_affine(weight, bias, x.shape[-1], x.device)
    return _triton_fp32_layer_norm(x, weight, bias, float(eps))
