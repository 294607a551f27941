"""``rms_norm_scale`` on CPU: diffusers' RMSNorm, the scale and the shift on row blocks.

Eager (Mochi's, Z-Image's, LTX's expressions) makes about eight full-size passes, most in
fp32 with a fresh allocation each (cast, pow, mean, rsqrt, mul, cast, mul, add, cast). Here
rows are walked in blocks whose fp32 scratch stays in cache: memory sees one read of x
and one write of the output. Every step is eager's operation in eager's dtype, rounded
where eager rounds (:mod:`ditops.ops.rms_norm_scale` states them): the norm as
:func:`~ditops.kernels.cpu.qk_norm_rope.rms_norm`'s exact mode (the mean of squares of
a row does not depend on the tensor it sits in), then an fp32 multiply by the scale's
rows and an add of the shift's, each rounded to eager's result dtype when that is
bf16/fp16 (the product or sum of two such numbers computed in fp32 and rounded once, as
ATen's CPU loops do). So both precisions give the meaning's bits.

The blocks are shared between the cores by :mod:`ditops.kernels.cpu.workers`; the
scratch is each worker thread's own (:func:`ditops.kernels.cpu.blocks.scratch`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ditops.kernels.cpu import blocks, workers
from ditops.kernels.opaque import opaque_op
from ditops.kernels.qk_norm_rope_tables import LOW_PRECISION, normed_dtype

#: fp32 bytes of one block (as the q/k kernels' blocks).
_BLOCK_BYTES = 2 * 1024 * 1024
_F32 = torch.float32


def out_dtypes(
    x: Tensor, scale: Tensor, shift: Tensor | None, weight: Tensor | None, upcast: bool
) -> tuple[torch.dtype, torch.dtype, torch.dtype, torch.dtype]:
    """Eager's dtypes: the norm's, the product's, the sum's and the output's."""
    norm = normed_dtype(
        _F32 if upcast else x.dtype, None if weight is None else weight.dtype, "diffusers"
    )
    prod = torch.promote_types(norm, scale.dtype)
    total = prod if shift is None else torch.promote_types(prod, shift.dtype)
    return norm, prod, total, x.dtype if upcast else total


def _rows(m: Tensor | None, b: int, l0: int, l1: int) -> Tensor | None:
    """The modulation rows of tokens ``l0:l1`` of sample ``b``: ``[1, C]`` or ``[n, C]``."""
    if m is None:
        return None
    if m.dim() == 1:
        return m.unsqueeze(0)
    mb = m[b if m.shape[0] > 1 else 0]
    return mb[:1] if mb.shape[0] == 1 else mb[l0:l1]


def _to_(a: Tensor, lp: Tensor) -> None:
    """Round fp32 ``a`` in place to ``lp``'s dtype (``lp``: scratch of that dtype)."""
    lp.copy_(a)  # round to nearest even, as .to() does
    a.copy_(lp)  # exact


def _inv_rms(a: Tensor, sq: Tensor, eps: float) -> Tensor:
    """``rsqrt(mean(a * a) + eps)`` per row of fp32 ``a`` (``sq``: scratch), ``[n, 1]``."""
    torch.mul(a, a, out=sq)
    return sq.mean(-1, keepdim=True).add_(eps).rsqrt_()


def _norm_(a: Tensor, sq: Tensor, eps: float, w32: Tensor | None, lp: Tensor | None) -> None:
    """``a`` (fp32 rows) becomes diffusers' RMSNorm of them: ``pow(2)`` (``x * x`` in
    ATen), ``mean``, ``+ eps``, ``rsqrt``, ``x * r``; with a bf16/fp16 weight rounded to
    its dtype first (``lp`` given), then times the weight (an exact fp32 product of two
    such numbers: the caller rounds it once, as eager's product)."""
    a.mul_(_inv_rms(a, sq, eps))
    if w32 is not None:
        if lp is not None:
            _to_(a, lp)
        a.mul_(w32)


@opaque_op("ditops::cpu_rms_norm_scale")
def rms_norm_scale(
    x: Tensor,
    scale: Tensor,
    shift: Tensor | None,
    weight: Tensor | None,
    eps: float,
    upcast: bool,
) -> Tensor:
    """``rms(x) * scale (+ shift)`` of ``x`` ``[B, L, C]`` with eager's roundings."""
    B, L, C = x.shape
    nd, pd, sd, od = out_dtypes(x, scale, shift, weight, upcast)
    out = torch.empty((B, L, C), dtype=od, device=x.device)
    if out.numel() == 0:
        return out
    w32 = None if weight is None else weight.to(_F32)
    low = nd in LOW_PRECISION  # every rounding below is to nd (see out_dtypes: pd, sd low => == nd)
    # A rounding to the output's dtype just before the copy out is the copy's own.
    round_prod = pd in LOW_PRECISION and not (shift is None and pd == od)
    round_sum = sd in LOW_PRECISION and sd != od
    same = scale.dtype == nd and (shift is None or shift.dtype == nd) and od == nd
    step = max(1, _BLOCK_BYTES // (4 * C))
    rows = min(step, L)
    items = [(b, l0, min(l0 + step, L)) for b in range(B) for l0 in range(0, L, step)]

    def body(scratch: blocks.Scratch) -> Callable[[tuple[int, int, int]], None]:
        a = scratch.take(0, rows, C, _F32)
        sq = scratch.take(1, rows, C, _F32)
        lp = scratch.take(2, rows, C, nd) if low else None

        def run(item: tuple[int, int, int]) -> None:
            b, l0, l1 = item
            n = l1 - l0
            av, lpv = a[:n], None if lp is None else lp[:n]
            av.copy_(x[b, l0:l1])
            if lpv is not None and same:
                # One low dtype throughout: eager's own ops in that dtype after the norm's
                # rounding, on half the bytes of the fp32 steps.
                # the fp32 product rounded once, by the write into nd: x * r then .to(nd)
                torch.mul(av, _inv_rms(av, sq[:n], eps), out=lpv)
                if weight is not None:
                    lpv.mul_(weight)
                o, sh = out[b, l0:l1], _rows(shift, b, l0, l1)
                if sh is None:
                    torch.mul(lpv, _rows(scale, b, l0, l1), out=o)
                else:
                    torch.add(lpv.mul_(_rows(scale, b, l0, l1)), sh, out=o)
                return
            # a bf16/fp16 weight is nd: the norm rounds to it before the weight
            _norm_(av, sq[:n], eps, w32, lpv if w32 is not None else None)
            if lpv is not None:
                _to_(av, lpv)  # the norm's output dtype
            if shift is None and not round_prod:  # the product's rounding is the write's
                torch.mul(av, _rows(scale, b, l0, l1), out=out[b, l0:l1])
                return
            av.mul_(_rows(scale, b, l0, l1))
            if lpv is not None and round_prod:
                _to_(av, lpv)
            sh = _rows(shift, b, l0, l1)
            if sh is not None:
                av.add_(sh)
                if lpv is not None and round_sum:
                    _to_(av, lpv)
            out[b, l0:l1].copy_(av)  # rounds to od: eager's last rounding when it is to od

        return run

    workers.run_items(items, body)
    return out


@rms_norm_scale.register_fake
def _(x, scale, shift, weight, eps, upcast):
    od = out_dtypes(x, scale, shift, weight, upcast)[3]
    return torch.empty(x.shape, dtype=od, device=x.device)
