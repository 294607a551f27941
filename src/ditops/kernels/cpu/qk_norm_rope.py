"""RMSNorm and rotary embedding of queries and keys on CPU, block by block.

Inputs are validated and normalised by :mod:`ditops.ops.qk_norm_rope_args`:
``q``/``k`` ``[B, L, H, D]`` (any strides), norm weights None or ``[N]`` (N = D per head,
H * D across heads) of any float dtype, cos/sin as :class:`PairTables` of ``[Bt, L, D/2]``
views. The arithmetic each mode reproduces is stated in :mod:`ditops.ops.qk_norm_rope`.

Memory model (bf16 q and k ``[1, 8192, 12, 128]``, Wan 1.3B). Eager runs about ten
full-size passes over each of q and k, most of them in fp32 with a fresh allocation each
(cast, pow, mean, rsqrt, mul, weight, cast, unbind, products, sum, cast). Here the rows
are walked in blocks whose fp32 scratch stays in cache, so memory sees one read of q
and k and one write of each output. q and k travel together: one ``[2, rows, H, D]``
fp32 block holds the rows of both, so every operation covers both (half the ATen calls
and parallel regions of two walks) and they share the block's tables.

* ``exact`` runs eager's operations on each block, in eager's dtypes, rounding where
  eager rounds: every one of them is elementwise or reduces each row on its own (the
  mean of squares included: ATen reduces a row the same way whatever the tensor it
  sits in; the tests check it against the full-tensor meaning, one 70000-wide row
  too). The rotation's products come from two full-width multiplications by tables
  laid out like the block, then one subtraction and one addition pair the members up.
* ``fast`` (the fused op) normalises with one ``vector_norm`` per row instead of eager's
  square-then-mean, keeps every intermediate in fp32 and rounds once at the end; it
  turns interleaved pairs with one angle each by one in-place complex multiplication,
  ``(x1 + i x2)(c + i s)``, and with one norm row per token (across heads) it folds the
  norm's reciprocal into the block's complex table instead of multiplying the block.
  (The complex multiply is not exact: ATen's vector loop rounds as the real arithmetic
  does, but its scalar remainder, at row ends and thread-chunk ends, may fuse a
  multiply-add; measured here, 14 elements of 1110 in a probe.) The standalone norm
  in fast mode keeps eager's roundings and changes only the reduction; the rotation
  alone is exact in both modes; fp32 outputs take the exact path (fp32 shows every
  reordering).

Scratch (the fp32 block, a second one for exact mode and real rotations, one of the
output dtype for roundings) is each worker thread's own, reused by every block and call
(a fresh allocation per block of this size hits glibc's mmap threshold: see the field
notes); the blocks are shared between the cores by :mod:`ditops.kernels.cpu.workers`.

Each kernel is a ``torch.library`` custom op (:func:`~ditops.kernels.opaque.opaque_op`),
so ``torch.compile`` calls it as one opaque op instead of unrolling the block loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
from torch import Tensor

from ditops.kernels.cpu import blocks, workers
from ditops.kernels.opaque import opaque_op
from ditops.kernels.qk_norm_rope_tables import (
    LOW_PRECISION,
    PairTables,
    normed_dtype,
    pair_tables,
)

#: fp32 bytes of the block (q and k rows together), chosen with
#: benchmarks/cpu/probes/qk_block_size.py (the share of a clone's bandwidth per block
#: size; rerun it on a new machine). Each block runs on one thread.
_BLOCK_BYTES = 2 * 1024 * 1024
_F32 = torch.float32


def _rows_per_block(width: int) -> int:
    """Rows of ``width`` fp32 elements per block: ``_BLOCK_BYTES`` (each block runs on
    one thread, :mod:`ditops.kernels.cpu.workers`)."""
    return max(1, _BLOCK_BYTES // max(1, 4 * width))


def _blocks(B: int, L: int, step: int) -> Iterator[tuple[int, int, int]]:
    for b in range(B):
        for l0 in range(0, L, step):
            yield b, l0, min(l0 + step, L)


class _Norm(NamedTuple):
    """The RMSNorm of the tensors of one call (q and k: same shapes, same weight dtype)."""

    w32: Tensor | None  # fp32 weights [T, 1, H, D] (across heads) or [T, 1, 1, D]; None: none
    round_before_weight: bool  # diffusers with a bf16/fp16 weight: round to its dtype first
    eps: float
    across: bool
    dtype: torch.dtype  # the normalised tensors' dtype


def _norm_of(
    weights: list[Tensor | None], x: Tensor, eps: float, across: bool, convention: str
) -> _Norm:
    H, D = x.shape[2], x.shape[3]
    w0 = weights[0]
    w32 = None
    if w0 is not None:
        shape = (1, H, D) if across else (1, 1, D)
        w32 = torch.stack([w.to(_F32).reshape(shape) for w in weights if w is not None])
    lp = w0 is not None and convention == "diffusers" and w0.dtype in LOW_PRECISION
    out = normed_dtype(x.dtype, None if w0 is None else w0.dtype, convention)
    return _Norm(w32, lp, eps, across, out)


def _round_(a: Tensor, lp: Tensor) -> None:
    """Round fp32 ``a`` to ``lp``'s dtype in place (``lp``: a block of that dtype, scratch)."""
    lp.copy_(a)  # round to nearest even, as .to() does
    a.copy_(lp)  # exact


def _reduce_view(a: Tensor, across: bool) -> Tensor:
    """The norm rows of a ``[T, n, H, D]`` block: ``[T, n, H * D]`` or the block itself."""
    T, n, H, D = a.shape
    return a.view(T, n, H * D) if across else a


# --- the norm ----------------------------------------------------------------------------


def _rms_exact(a: Tensor, sq: Tensor, norm: _Norm, lp: Tensor | None) -> None:
    """``a`` (fp32 input) becomes the normalised value, rounded where eager rounds.

    Eager (torch 2.13's ``F.rms_norm`` and diffusers' ``RMSNorm``, whose first steps are
    the same): ``x32.pow(2).mean(-1, keepdim=True)``, ``+ eps``, ``rsqrt``, ``x32 * r``;
    ``pow(2)`` is ``x * x`` in ATen. Then the weight: in fp32 (``torch``; diffusers with an
    fp32 weight), or after rounding to a bf16/fp16 weight's dtype (diffusers), where the
    product of two such numbers is exact in fp32 and rounds once, as eager's does. The
    last rounding, to the normalised dtype, is the caller's.
    """
    torch.mul(a, a, out=sq)
    r = _reduce_view(sq, norm.across).mean(-1, keepdim=True)
    r.add_(norm.eps).rsqrt_()
    _reduce_view(a, norm.across).mul_(r)
    if norm.w32 is not None:
        if norm.round_before_weight:
            assert lp is not None
            _round_(a, lp)
        a.mul_(norm.w32)


def _rms_scale_fast(a: Tensor, norm: _Norm) -> Tensor:
    """``rsqrt(mean(a^2) + eps)`` per norm row, from one ``vector_norm`` pass: ``[T, n, 1]``
    (across heads) or ``[T, n, H, 1]``."""
    red = _reduce_view(a, norm.across)
    r = torch.linalg.vector_norm(red, dim=-1, keepdim=True)
    return r.square_().mul_(1.0 / red.shape[-1]).add_(norm.eps).rsqrt_()


# --- the rotation ----------------------------------------------------------------------------


class _BlockTables(NamedTuple):
    """One block's tables, ``[n, 1, D/2]`` each, in the computation dtype; for the exact
    fp32 rotation also two full-width ``[n, 1, D]`` tables laid out like the block."""

    c1: Tensor
    s1: Tensor
    c2: Tensor
    s2: Tensor
    cc: Tensor | None  # c1 at first members, c2 at second members
    ss: Tensor | None  # s2 at first members, s1 at second members (the swap is intended)
    rot: Tensor | None  # c1 + i s1 (complex64): the fast form of interleaved pairs


def _block_tables(
    tabs: PairTables, b: int, l0: int, l1: int, dtype: torch.dtype, layout: str, form: str
) -> _BlockTables:
    bt = b if tabs.c1.shape[0] > 1 else 0

    def rows(t: Tensor) -> Tensor:
        return t[bt, l0:l1].to(dtype).unsqueeze(1)

    c1, s1 = rows(tabs.c1), rows(tabs.s1)
    if tabs.paired:
        c2, s2 = c1, s1
    else:
        c2, s2 = rows(tabs.c2), rows(tabs.s2)
    cc = ss = rot = None
    if form == "complex":
        rot = torch.complex(c1, s1)
    elif form == "real":
        cc, ss = _merge(c1, c2, layout), _merge(s2, s1, layout)
    return _BlockTables(c1, s1, c2, s2, cc, ss, rot)


def _merge(first: Tensor, second: Tensor, layout: str) -> Tensor:
    """A full-width table with ``first`` at the first members of the pairs, ``second`` at
    the second ones."""
    if layout == "interleaved":
        return torch.stack([first, second], dim=-1).flatten(-2)
    return torch.cat([first, second], dim=-1)


def _members(t: Tensor, layout: str) -> tuple[Tensor, Tensor]:
    """The first and second members of every pair of a ``[..., D]`` block, as views."""
    if layout == "interleaved":
        return t[..., 0::2], t[..., 1::2]
    h = t.shape[-1] // 2
    return t[..., :h], t[..., h:]


def _rotate_real(a: Tensor, tmp: Tensor, t: _BlockTables, layout: str) -> None:
    """In place, with eager's roundings: first = x1 * c1 - x2 * s1, second = x2 * c2 +
    x1 * s2 (eager's ``x * cos + rotate(x) * sin``: ``rotate`` negates, and ``p + (-q)``
    is ``p - q`` in IEEE arithmetic). Both products of every element come from two
    full-width multiplications; only the final sum and difference pair members up
    (strided for interleaved pairs)."""
    assert t.cc is not None and t.ss is not None
    torch.mul(a, t.ss, out=tmp)  # x1 * s2 | x2 * s1
    a.mul_(t.cc)  # x1 * c1 | x2 * c2
    x1, x2 = _members(a, layout)
    t1, t2 = _members(tmp, layout)
    x1.sub_(t2)
    x2.add_(t1)


def _rotate_low_precision(out: Tensor, t: _BlockTables, layout: str) -> None:
    """The rotation in a bf16/fp16 computation dtype (bf16 activations and bf16 tables):
    ``out`` holds the input in that dtype and receives the result; every product and sum
    rounds to it, as eager's do (a rare path: it allocates)."""
    x1, x2 = _members(out, layout)
    first = x1 * t.c1 - x2 * t.s1
    second = x2 * t.c2 + x1 * t.s2
    x1.copy_(first)
    x2.copy_(second)


# --- the walk --------------------------------------------------------------------------------


class _Plan(NamedTuple):
    """What every block of a call does."""

    norm: _Norm | None
    layout: str
    compute: torch.dtype | None  # the rotation's computation dtype; None: no rotation
    form: str  # the rotation: "complex" (fast), "real" (fp32, exact) or "lp" (bf16/fp16)
    exact: bool
    round_normed: bool  # round the normalised value where eager does (all but fused fast)


def _block(
    a: Tensor, sq: Tensor | None, lp: Tensor | None, plan: _Plan, t: _BlockTables | None
) -> Tensor:
    """Normalise and/or rotate the ``[T, n, H, D]`` fp32 block ``a`` (the inputs, widened)
    in place; returns the block holding the result (``a``, or ``lp`` for a rotation
    computed in bf16/fp16), which the caller copies out, rounding to the output dtype."""
    norm = plan.norm
    fold: Tensor | None = None  # fast, across heads: the norm scale goes into the table
    if norm is not None:
        if plan.exact:
            assert sq is not None
            _rms_exact(a, sq, norm, lp)
        else:
            r = _rms_scale_fast(a, norm)
            if norm.across and not plan.round_normed and t is not None and t.rot is not None:
                fold = r
            else:
                _reduce_view(a, norm.across).mul_(r)
            if norm.w32 is not None:
                if plan.round_normed and norm.round_before_weight:
                    assert lp is not None
                    _round_(a, lp)
                a.mul_(norm.w32)
        if t is None:
            return a  # the standalone norm: the copy out is its last rounding
        if plan.round_normed and norm.dtype != _F32:
            assert lp is not None
            _round_(a, lp)
    assert t is not None
    if plan.form == "lp":
        assert lp is not None
        lp.copy_(a)  # exact: ``a`` holds values of that dtype
        _rotate_low_precision(lp, t, plan.layout)
        return lp
    if plan.form == "complex":
        assert t.rot is not None
        T, n, H, D = a.shape
        rot = t.rot if fold is None else t.rot * fold.view(T, n, 1, 1)
        torch.view_as_complex(a.view(T, n, H, D // 2, 2)).mul_(rot)
    else:
        assert sq is not None
        _rotate_real(a, sq, t, plan.layout)
    return a


def _run(
    xs: list[Tensor],
    norm: _Norm | None,
    tabs: PairTables | None,
    layout: str,
    exact: bool,
    round_normed: bool,
) -> list[Tensor]:
    """Walk the row blocks of the ``[B, L, H, D]`` tensors ``xs`` (q and k: same shape and
    dtype) together: one ``[T, rows, H, D]`` fp32 block holds the rows of all of them,
    so every operation covers q and k at once and they share the block's tables.
    Returns the outputs (contiguous)."""
    T = len(xs)
    B, L, H, D = xs[0].shape
    dtype = norm.dtype if norm is not None else xs[0].dtype
    outs = [torch.empty((B, L, H, D), dtype=dtype, device=x.device) for x in xs]
    if outs[0].numel() == 0:
        return outs
    compute = None
    form = ""
    if tabs is not None:
        # The meaning rotates in promote(normalised dtype, table dtype).
        compute = torch.promote_types(dtype, tabs.c1.dtype)
        if not round_normed:
            if compute in LOW_PRECISION:
                # Eager rounds every step of the rotation to bf16/fp16 here, which one
                # rounding of fp32 arithmetic cannot follow within tolerance: eager's steps.
                return _run(xs, norm, tabs, layout, True, True)
            compute = _F32
        # Fast mode turns interleaved pairs with one angle each by a complex multiply:
        # ATen's vector loop rounds it as the real arithmetic, but its scalar remainder
        # (row ends, thread-chunk ends) may fuse a multiply-add, so exact mode keeps to
        # real multiplications.
        if compute in LOW_PRECISION:
            form = "lp"
        elif not exact and layout == "interleaved" and tabs.paired:
            form = "complex"
        else:
            form = "real"
    step = _rows_per_block(T * H * D)
    rows = min(step, L)
    rounds = (
        norm is not None
        and round_normed
        and ((tabs is not None and dtype != _F32) or norm.round_before_weight)
    )
    plan = _Plan(norm, layout, compute, form, exact, round_normed)

    def body(scratch: blocks.Scratch) -> Callable[[tuple[int, int, int]], None]:
        def take(slot: int, dt: torch.dtype) -> Tensor:
            return scratch.take(slot, T * rows, H * D, dt).view(T, rows, H, D)

        a = take(0, _F32)
        sq = take(1, _F32) if exact or form == "real" else None
        lp = take(2, dtype) if rounds or form == "lp" else None

        def cut(buf: Tensor | None, n: int) -> Tensor | None:
            return buf if buf is None or n == rows else buf[:, :n]

        def run(block: tuple[int, int, int]) -> None:
            b, l0, l1 = block
            av = cut(a, l1 - l0)
            assert av is not None
            for i, x in enumerate(xs):
                av[i].copy_(x[b, l0:l1])
            t = None
            if tabs is not None:
                assert compute is not None
                t = _block_tables(tabs, b, l0, l1, compute, layout, form)
            res = _block(av, cut(sq, l1 - l0), cut(lp, l1 - l0), plan, t)
            for i, out in enumerate(outs):
                out[b, l0:l1].copy_(res[i])

        return run

    workers.run_items(list(_blocks(B, L, step)), body)
    return outs


# --- the custom ops ---------------------------------------------------------------------


@opaque_op("ditops::cpu_rms_norm")
def rms_norm(x: Tensor, weight: Tensor | None, eps: float, convention: str, exact: bool) -> Tensor:
    """RMSNorm over the last dim of ``x`` (any shape); ``exact`` gives eager's bits, fast
    changes only the reduction (see the module docstring)."""
    N = x.shape[-1]
    rows = x.reshape(1, -1, 1, N)
    norm = _norm_of([weight], rows, eps, False, convention)
    # An fp32 output shows every reordering of fp32 arithmetic: fast gives the exact bits.
    exact = exact or norm.dtype == _F32
    (out,) = _run([rows], norm, None, "interleaved", exact, True)
    return out.reshape(x.shape)


@rms_norm.register_fake
def _(x, weight, eps, convention, exact):
    dtype = normed_dtype(x.dtype, None if weight is None else weight.dtype, convention)
    return torch.empty(x.shape, dtype=dtype, device=x.device)


@opaque_op("ditops::cpu_rotary_embedding")
def rotary_embedding(x: Tensor, cos: Tensor, sin: Tensor, layout: str) -> Tensor:
    """The rotation of ``x`` [B, L, H, D] by ``[Bt, L, Dt]`` tables; bitwise eager's."""
    tabs = pair_tables(cos, sin, x.shape[-1], layout)
    (out,) = _run([x], None, tabs, layout, True, True)
    return out


@rotary_embedding.register_fake
def _(x, cos, sin, layout):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@opaque_op("ditops::cpu_qk_norm_rope")
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
    exact: bool,
) -> tuple[Tensor, Tensor]:
    """RMSNorm then rotation of q and k [B, L, H, D] in one walk over their rows.

    ``exact``: eager's bits (rounded where eager rounds); otherwise rounded once.
    """
    tabs = pair_tables(cos, sin, q.shape[-1], layout)
    norm = _norm_of([q_weight, k_weight], q, eps, across_heads, convention)
    exact = exact or norm.dtype == _F32  # as in rms_norm
    qo, ko = _run([q, k], norm, tabs, layout, exact, exact)
    return qo, ko


@qk_norm_rope.register_fake
def _(q, k, q_weight, k_weight, cos, sin, eps, across_heads, layout, convention, exact):
    def out(x: Tensor, w: Tensor | None) -> Tensor:
        dtype = normed_dtype(x.dtype, None if w is None else w.dtype, convention)
        return torch.empty(x.shape, dtype=dtype, device=x.device)

    return out(q, q_weight), out(k, k_weight)
