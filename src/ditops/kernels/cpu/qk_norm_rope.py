"""RMSNorm and rotary embedding of queries and keys on CPU, block by block.

Inputs are validated and normalised by :mod:`ditops.kernels.qk_norm_rope_shapes`:
``q``/``k`` ``[B, L, H, D]`` (any strides), norm weights None or ``[N]`` (N = D per head,
H * D across heads) of any float dtype, cos/sin as :class:`PairTables` of ``[Bt, L, D/2]``
views. The arithmetic each mode reproduces is stated in :mod:`ditops.layers.qk_norm_rope`.

Memory model (bf16 q and k ``[1, 8192, 12, 128]``, Wan 1.3B). Eager runs about ten
full-size passes over each of q and k, most of them in fp32 with a fresh allocation each
(cast, pow, mean, rsqrt, mul, weight, cast, unbind, products, sum, cast). Here the rows
are walked in blocks whose fp32 scratch stays in cache, so memory sees one read of q
and k and one write of each output; q and k share each block's rotation table.

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

Scratch is two fp32 blocks allocated once per call and reused by every block (a fresh
allocation per block of this size hits glibc's mmap threshold: see the field notes);
the output block itself serves as the scratch of a rounding to the output dtype.

Each kernel is a ``torch.library`` custom op (:func:`~ditops.kernels.opaque.opaque_op`),
so ``torch.compile`` calls it as one opaque op instead of unrolling the block loop.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import Tensor

from ditops.kernels.opaque import opaque_op
from ditops.kernels.qk_norm_rope_shapes import LOW_PRECISION, PairTables, normed_dtype, pair_tables

#: fp32 bytes per block of rows (one scratch block). Measured with
#: benchmarks/cpu/probes/qk_block_size.py: see the constant's history in git.
_BLOCK_BYTES = 1024 * 1024
_F32 = torch.float32


def _rows_per_block(width: int) -> int:
    return max(1, _BLOCK_BYTES // max(1, 4 * width))


def _blocks(B: int, L: int, step: int) -> Iterator[tuple[int, int, int]]:
    for b in range(B):
        for l0 in range(0, L, step):
            yield b, l0, min(l0 + step, L)


class _Norm(NamedTuple):
    """One tensor's RMSNorm, ready for the blocks."""

    w32: Tensor | None  # fp32 weight shaped [H, D] (across heads) or [D]; None: no weight
    round_before_weight: torch.dtype | None  # diffusers with a bf16/fp16 weight: its dtype
    eps: float
    across: bool
    dtype: torch.dtype  # the normalised tensor's dtype


def _norm_of(weight: Tensor | None, x: Tensor, eps: float, across: bool, convention: str) -> _Norm:
    H, D = x.shape[2], x.shape[3]
    w32 = None
    if weight is not None:
        w32 = weight.to(_F32).reshape(H, D) if across else weight.to(_F32)
    lp = weight is not None and convention == "diffusers" and weight.dtype in LOW_PRECISION
    out = normed_dtype(x.dtype, None if weight is None else weight.dtype, convention)
    return _Norm(w32, weight.dtype if lp else None, eps, across, out)


class _Scratch:
    """Two fp32 blocks reused by every block of a call."""

    def __init__(self, rows: int, H: int, D: int) -> None:
        self.rows = rows
        self.a = torch.empty((rows, H, D), dtype=_F32)
        self.b = torch.empty((rows, H, D), dtype=_F32)

    def take(self, n: int) -> tuple[Tensor, Tensor]:
        if n == self.rows:
            return self.a, self.b
        return self.a[:n], self.b[:n]


def _round_(a: Tensor, lp: Tensor) -> None:
    """Round fp32 ``a`` to ``lp``'s dtype in place (``lp``: a block of that dtype, scratch)."""
    lp.copy_(a)  # round to nearest even, as .to() does
    a.copy_(lp)  # exact


def _reduce_view(a: Tensor, across: bool) -> Tensor:
    n, H, D = a.shape
    return a.view(n, H * D) if across else a


# --- the norm ----------------------------------------------------------------------------


def _rms_exact(a: Tensor, sq: Tensor, norm: _Norm, lp: Tensor) -> None:
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
        if norm.round_before_weight is not None:
            _round_(a, lp)
        a.mul_(norm.w32)


def _rms_scale_fast(a: Tensor, norm: _Norm) -> Tensor:
    """``rsqrt(mean(a^2) + eps)`` per norm row, from one ``vector_norm`` pass: ``[n, 1]``
    (across heads) or ``[n, H, 1]``."""
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
    """The first and second members of every pair of a ``[n, H, D]`` block, as views."""
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


# --- one block of one tensor --------------------------------------------------------------


class _Plan(NamedTuple):
    """What every block of a call does."""

    norm: _Norm | None
    layout: str
    compute: torch.dtype | None  # the rotation's computation dtype; None: no rotation
    use_complex: bool
    exact: bool
    round_normed: bool  # round the normalised value where eager does (all but fused fast)


def _block(
    xb: Tensor, ob: Tensor, a: Tensor, sq: Tensor, plan: _Plan, t: _BlockTables | None
) -> None:
    """Normalise and/or rotate one ``[n, H, D]`` block ``xb`` into ``ob``."""
    a.copy_(xb)
    norm = plan.norm
    fold: Tensor | None = None  # fast, across heads: the norm scale goes into the table
    if norm is not None:
        if plan.exact:
            _rms_exact(a, sq, norm, ob)
        else:
            r = _rms_scale_fast(a, norm)
            if norm.across and not plan.round_normed and t is not None and t.rot is not None:
                fold = r
            else:
                _reduce_view(a, norm.across).mul_(r)
            if norm.w32 is not None:
                if plan.round_normed and norm.round_before_weight is not None:
                    _round_(a, ob)
                a.mul_(norm.w32)
        if t is None:
            ob.copy_(a)  # the standalone norm: its one last rounding
            return
        if plan.round_normed and norm.dtype != _F32:
            _round_(a, ob)
    assert t is not None
    if plan.compute in LOW_PRECISION:
        ob.copy_(a)  # exact: ``a`` holds values of that dtype
        _rotate_low_precision(ob, t, plan.layout)
        return
    if t.rot is not None:
        rot = t.rot if fold is None else t.rot * fold.view(-1, 1, 1)
        n, H, D = a.shape
        torch.view_as_complex(a.view(n, H, D // 2, 2)).mul_(rot)
    else:
        _rotate_real(a, sq, t, plan.layout)
    ob.copy_(a)


def _run(
    xs: list[tuple[Tensor, _Norm | None]],
    tabs: PairTables | None,
    layout: str,
    exact: bool,
    round_normed: bool,
) -> list[Tensor]:
    """Walk the row blocks of every ``[B, L, H, D]`` tensor in ``xs`` (same shape), sharing
    each block's tables, and return the outputs (contiguous)."""
    B, L, H, D = xs[0][0].shape
    outs = []
    for x, norm in xs:
        dtype = norm.dtype if norm is not None else x.dtype
        outs.append(torch.empty((B, L, H, D), dtype=dtype, device=x.device))
    if outs[0].numel() == 0:
        return outs
    compute = None
    use_complex = False
    if tabs is not None:
        # The meaning rotates in promote(normalised dtype, table dtype); q and k share it.
        compute = torch.promote_types(outs[0].dtype, tabs.c1.dtype)
        if not round_normed:
            if compute in LOW_PRECISION:
                # Eager rounds every step of the rotation to bf16/fp16 here, which one
                # rounding of fp32 arithmetic cannot follow within tolerance: eager's steps.
                return _run(xs, tabs, layout, True, True)
            compute = _F32
        # Fast mode turns interleaved pairs with one angle each by a complex multiply:
        # ATen's vector loop rounds it as the real arithmetic, but its scalar remainder
        # (row ends, thread-chunk ends) may fuse a multiply-add, so exact mode keeps to
        # real multiplications.
        use_complex = not exact and layout == "interleaved" and tabs.paired
    step = _rows_per_block(H * D)
    scratch = _Scratch(min(step, L), H, D)
    plans = [_Plan(norm, layout, compute, use_complex, exact, round_normed) for _, norm in xs]
    for b, l0, l1 in _blocks(B, L, step):
        a, sq = scratch.take(l1 - l0)
        t = None
        if tabs is not None:
            assert compute is not None
            form = "complex" if use_complex else ("real" if compute == _F32 else "lp")
            t = _block_tables(tabs, b, l0, l1, compute, layout, form)
        for (x, _), out, plan in zip(xs, outs, plans):
            _block(x[b, l0:l1], out[b, l0:l1], a, sq, plan, t)
    return outs


# --- the custom ops ---------------------------------------------------------------------


@opaque_op("ditops::cpu_rms_norm")
def rms_norm(x: Tensor, weight: Tensor | None, eps: float, convention: str, exact: bool) -> Tensor:
    """RMSNorm over the last dim of ``x`` (any shape); ``exact`` gives eager's bits, fast
    changes only the reduction (see the module docstring)."""
    N = x.shape[-1]
    rows = x.reshape(1, -1, 1, N)
    norm = _norm_of(weight, rows, eps, False, convention)
    # An fp32 output shows every reordering of fp32 arithmetic: fast gives the exact bits.
    exact = exact or norm.dtype == _F32
    (out,) = _run([(rows, norm)], None, "interleaved", exact, True)
    return out.reshape(x.shape)


@rms_norm.register_fake
def _(x, weight, eps, convention, exact):
    dtype = normed_dtype(x.dtype, None if weight is None else weight.dtype, convention)
    return torch.empty(x.shape, dtype=dtype, device=x.device)


@opaque_op("ditops::cpu_rotary_embedding")
def rotary_embedding(x: Tensor, cos: Tensor, sin: Tensor, layout: str) -> Tensor:
    """The rotation of ``x`` [B, L, H, D] by ``[Bt, L, Dt]`` tables; bitwise eager's."""
    tabs = pair_tables(cos, sin, x.shape[-1], layout)
    (out,) = _run([(x, None)], tabs, layout, True, True)
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
    qn = _norm_of(q_weight, q, eps, across_heads, convention)
    kn = _norm_of(k_weight, k, eps, across_heads, convention)
    exact = exact or qn.dtype == _F32  # as in rms_norm
    qo, ko = _run([(q, qn), (k, kn)], tabs, layout, exact, exact)
    return qo, ko


@qk_norm_rope.register_fake
def _(q, k, q_weight, k_weight, cos, sin, eps, across_heads, layout, convention, exact):
    def out(x: Tensor, w: Tensor | None) -> Tensor:
        dtype = normed_dtype(x.dtype, None if w is None else w.dtype, convention)
        return torch.empty(x.shape, dtype=dtype, device=x.device)

    return out(q, q_weight), out(k, k_weight)
