"""Triton kernels for the attention prologue on GPUs: RMSNorm, rotary embedding, both fused.

Inputs come validated by :mod:`ditops.ops.qk_norm_rope_args` (shapes, dtypes, devices);
the arithmetic each op means is stated in :mod:`ditops.ops.qk_norm_rope`.

``_norm_rope_kernel`` rotates (and optionally first normalises) one ``[B, L, H, D]``
tensor (one launch for q, one for k). A program holds ``BLOCK_R`` norm rows as a
``[BLOCK_R, BLOCK_P]`` tile of rotated pairs: a norm row is one head (per-head norm,
``P = D/2`` pairs) or one token (across heads, ``P = H * D/2``); the two members of every
pair come as two tiles: interleaved pairs are loaded as one contiguous tile and split in
registers (``tl.split``/``tl.join``: coalesced loads and stores), halves as two tiles
``x[i]``/``x[i + D/2]``. The sum of squares, the normalisation, the
weight and the rotation are done in fp32 registers and the result is rounded once.
Without the norm (the rotary op) the launch disables FMA contraction
(``enable_fp_fusion=False``), so each product and the sum round as eager's do and the
result is bitwise eager's (the tests assert it under the interpreter).

``_rms_norm_kernel`` is the standalone norm over the last dim with eager's roundings
(diffusers' rounding to a bf16/fp16 weight's dtype before the weight included): the
statistics are summed in another order than ATen's, hence a "fast" path.

Rounding to bf16 goes through ``layer_norm.round_rne`` (nearest even on GPUs and under
the interpreter, whose own cast truncates).

Bandwidth model (bytes per element; a = activation size): read q and k, write both:
``4a`` for the pair (bf16: 8 B per element of q); the weights (``[D]`` or ``[H * D]``) and
the tables (``[L, D/2]``: 1/H of an activation in fp32) come from cache. One pass over
memory, against about ten for eager.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ditops.kernels.opaque import opaque_op
from ditops.kernels.qk_norm_rope_tables import (
    LOW_PRECISION,
    PairTables,
    normed_dtype,
    pair_tables,
)
from ditops.kernels.triton.rows import round_rne, row_view, split_rows

#: Target elements of one tile (both members of the pairs): narrow rows share a program.
TILE_ELEMENTS = 4096


@triton.jit
def _norm_rope_kernel(
    X,
    W,
    Out,
    C1,
    S1,
    C2,
    S2,
    n_rows,
    L,
    H,
    HR,
    eps,
    inv_n,
    x_sb,
    x_sl,
    x_sh,
    c_sb,
    c_sl,
    c_sd,
    s_sb,
    s_sl,
    s_sd,
    HALF: tl.constexpr,
    P: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    HAS_NORM: tl.constexpr,
    HAS_W: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    PAIRED: tl.constexpr,
):
    """Norm rows ``[pid * BLOCK_R, +BLOCK_R)`` of one ``[B, L, H, D]`` tensor.

    A norm row is (token, head) when ``HR == H`` (per head) or a token when ``HR == 1``
    (across heads); token t is (b, l) = (t // L, t % L). The output is contiguous.
    """
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    rows = tl.where(rmask, rows, 0).to(tl.int64)
    tok = rows // HR
    b, pos = split_rows(tok, L)
    h0 = rows % HR  # the first head of the norm row
    base = b * x_sb + pos * x_sl
    D: tl.constexpr = 2 * HALF
    p = tl.arange(0, BLOCK_P)
    j = p % HALF  # the pair within its head
    mask = rmask[:, None] & (p < P)[None, :]
    if INTERLEAVED:
        # The row's elements as one contiguous tile, split into pair members in registers
        # (coalesced loads and stores; element e of the norm row is head e // D, dim e % D).
        e = tl.arange(0, 2 * BLOCK_P)
        emask = rmask[:, None] & (e < 2 * P)[None, :]
        x_off = base[:, None] + (h0[:, None] + (e // D)[None, :]) * x_sh + (e % D)[None, :]
        xe = tl.load(X + x_off, mask=emask, other=0.0).to(tl.float32)
        x1, x2 = tl.split(tl.reshape(xe, [BLOCK_R, BLOCK_P, 2]))
    else:
        hh = h0[:, None] + (p // HALF)[None, :]  # the head of every pair
        x_off = base[:, None] + hh * x_sh + j[None, :]
        x1 = tl.load(X + x_off, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(X + x_off + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        ss = tl.sum(x1 * x1 + x2 * x2, axis=1)
        r = tl.math.div_rn(1.0, tl.sqrt_rn(ss * inv_n + eps))
        x1 = x1 * r[:, None]
        x2 = x2 * r[:, None]
        if HAS_W:  # the weight of element e of a norm row is W[e]
            if INTERLEAVED:
                we = tl.load(W + e, mask=e < 2 * P, other=0.0).to(tl.float32)
                w1, w2 = tl.split(tl.reshape(we, [BLOCK_P, 2]))
            else:
                w_off = (p // HALF) * D + j
                w1 = tl.load(W + w_off, mask=p < P, other=0.0).to(tl.float32)
                w2 = tl.load(W + w_off + HALF, mask=p < P, other=0.0).to(tl.float32)
            x1 = x1 * w1[None, :]
            x2 = x2 * w2[None, :]
    c_off = (b * c_sb + pos * c_sl)[:, None] + j[None, :] * c_sd
    s_off = (b * s_sb + pos * s_sl)[:, None] + j[None, :] * s_sd
    c1 = tl.load(C1 + c_off, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(S1 + s_off, mask=mask, other=0.0).to(tl.float32)
    if PAIRED:
        c2 = c1
        s2 = s1
    else:
        c2 = tl.load(C2 + c_off, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(S2 + s_off, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * c1 - x2 * s1
    o2 = x2 * c2 + x1 * s2
    odt = Out.dtype.element_ty
    o_row = (tok * H + h0) * D  # contiguous output: the norm row's first element
    if INTERLEAVED:
        o = tl.reshape(tl.join(o1, o2), [BLOCK_R, 2 * BLOCK_P])
        tl.store(Out + o_row[:, None] + e[None, :], round_rne(o, odt), mask=emask)
    else:
        o_off = o_row[:, None] + (p // HALF)[None, :] * D + j[None, :]
        tl.store(Out + o_off, round_rne(o1, odt), mask=mask)
        tl.store(Out + o_off + HALF, round_rne(o2, odt), mask=mask)


@triton.jit
def _rms_norm_kernel(
    X,
    W,
    Out,
    n_rows,
    L,
    N,
    eps,
    inv_n,
    x_sb,
    x_sl,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_W: tl.constexpr,
    ROUND_BEFORE_W: tl.constexpr,
):
    """RMSNorm of ``BLOCK_R`` rows of width N (rows on a [B, L] grid of strides x_sb, x_sl)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    b, pos = split_rows(tl.where(rmask, rows, 0), L)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    mask = rmask[:, None] & cmask[None, :]
    x = tl.load(X + (b * x_sb + pos * x_sl)[:, None] + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    ss = tl.sum(x * x, axis=1)
    y = x * tl.math.div_rn(1.0, tl.sqrt_rn(ss * inv_n + eps))[:, None]
    if HAS_W:
        if ROUND_BEFORE_W:
            y = round_rne(y, W.dtype.element_ty).to(tl.float32)
        y = y * tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    o_off = rows.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(Out + o_off, round_rne(y, Out.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------


def _warps(elements: int) -> int:
    return min(16, max(4, elements // 1024))


def _launch_norm_rope(
    x: Tensor,
    w: Tensor | None,
    out: Tensor,
    tabs: PairTables,
    layout: str,
    eps: float,
    across: bool | None,
) -> None:
    """One launch over ``x`` [B, L, H, D]. ``across`` None: no norm (the rotary op)."""
    B, L, H, D = x.shape
    if out.numel() == 0:
        return
    if x.stride(-1) != 1:
        x = x.contiguous()
    half = D // 2
    P = half * (H if across else 1)  # pairs per norm row
    n_rows = B * L * (1 if across else H)
    block_p = triton.next_power_of_2(P)
    block_r = max(1, min(TILE_ELEMENTS // (2 * block_p), triton.next_power_of_2(n_rows)))

    def bstride(t: Tensor) -> int:
        return t.stride(0) if t.shape[0] > 1 else 0

    _norm_rope_kernel[(triton.cdiv(n_rows, block_r),)](
        x,
        w if w is not None else x,
        out,
        tabs.c1,
        tabs.s1,
        tabs.c2,
        tabs.s2,
        n_rows,
        L,
        H,
        1 if across else H,
        eps,
        1.0 / (H * D if across else D),
        x.stride(0),
        x.stride(1),
        x.stride(2),
        bstride(tabs.c1),
        tabs.c1.stride(1),
        tabs.c1.stride(2),
        bstride(tabs.s1),
        tabs.s1.stride(1),
        tabs.s1.stride(2),
        HALF=half,
        P=P,
        BLOCK_R=block_r,
        BLOCK_P=block_p,
        HAS_NORM=across is not None,
        HAS_W=w is not None,
        INTERLEAVED=layout == "interleaved",
        PAIRED=tabs.paired,
        num_warps=_warps(2 * block_r * block_p),
        enable_fp_fusion=across is not None,
    )


def _out(x: Tensor, w: Tensor | None, convention: str | None) -> Tensor:
    dtype = (
        x.dtype
        if convention is None
        else normed_dtype(x.dtype, None if w is None else w.dtype, convention)
    )
    return torch.empty(x.shape, dtype=dtype, device=x.device)


@opaque_op("ditops::triton_qk_norm_rope")
def qk_norm_rope(
    q: Tensor,
    k: Tensor,
    q_weight: Tensor | None,
    k_weight: Tensor | None,
    cos: Tensor,
    sin: Tensor,
    eps: float,
    across_heads: bool,
    layout: str,
    convention: str,
) -> tuple[Tensor, Tensor]:
    """Normalise and rotate q and k ``[B, L, H, D]``, rounded once (fast precision).

    ``cos``/``sin`` are ``[Bt, L, Dt]``; the rotation is computed in fp32 (the layer sends
    bf16-computed rotations to the meaning).
    """
    tabs = pair_tables(cos, sin, q.shape[-1], layout)
    qo, ko = _out(q, q_weight, convention), _out(k, k_weight, convention)
    _launch_norm_rope(q, q_weight, qo, tabs, layout, eps, across_heads)
    _launch_norm_rope(k, k_weight, ko, tabs, layout, eps, across_heads)
    return qo, ko


@qk_norm_rope.register_fake
def _(q, k, q_weight, k_weight, cos, sin, eps, across_heads, layout, convention):
    return _out(q, q_weight, convention), _out(k, k_weight, convention)


@opaque_op("ditops::triton_rotary_embedding")
def rotary_embedding(x: Tensor, cos: Tensor, sin: Tensor, layout: str) -> Tensor:
    """The rotation of ``x`` [B, L, H, D]; bitwise eager's when computed in fp32."""
    out = _out(x, None, None)
    _launch_norm_rope(x, None, out, pair_tables(cos, sin, x.shape[-1], layout), layout, 0.0, None)
    return out


@rotary_embedding.register_fake
def _(x, cos, sin, layout):
    return _out(x, None, None)


@opaque_op("ditops::triton_rms_norm")
def rms_norm(x: Tensor, weight: Tensor | None, eps: float, convention: str) -> Tensor:
    """RMSNorm over the last dim of ``x`` (any rank >= 1) with eager's roundings."""
    out = _out(x, weight, convention)
    n = x.shape[-1]
    if out.numel() == 0:
        return out
    rows, length, x_sb, x_sl = row_view(x)
    n_rows = x.numel() // n
    block_n = triton.next_power_of_2(n)
    block_r = max(1, min(TILE_ELEMENTS // block_n, triton.next_power_of_2(n_rows)))
    lp = weight is not None and convention == "diffusers" and weight.dtype in LOW_PRECISION
    _rms_norm_kernel[(triton.cdiv(n_rows, block_r),)](
        rows,
        weight if weight is not None else rows,
        out,
        n_rows,
        length,
        n,
        eps,
        1.0 / n,
        x_sb,
        x_sl,
        BLOCK_R=block_r,
        BLOCK_N=block_n,
        HAS_W=weight is not None,
        ROUND_BEFORE_W=lp,
        num_warps=_warps(block_r * block_n),
    )
    return out


@rms_norm.register_fake
def _(x, weight, eps, convention):
    return _out(x, weight, convention)
