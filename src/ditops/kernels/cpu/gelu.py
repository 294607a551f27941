"""``gelu(x + bias, approximate="tanh")`` on CPU, in x's dtype, bitwise eager's.

Memory model for bf16 ``[R, C]``: eager writes the sum ``x + bias`` to a temporary and
reads it back for the GELU, 8 bytes per element (read x 2, write 2, read 2, write the
output 2) where a copy moves 4. This kernel runs the same two ATen calls on blocks of
rows small enough that the block's sum stays in L2 (``torch.add(..., out=)`` into a
scratch block, the GELU written straight into the output): 4 bytes per element from
memory. Timings: benchmarks/cpu/probes/gelu.txt.

Why the blocks keep eager's bits: the sum is one IEEE addition per element (``out=``
rounds as ``.to`` does), but ATen's GELU gives other bits for some inputs in its scalar
loop than in its vector loop (tanh differs), and it runs the scalar loop on the last
``n mod (2 * lanes)`` elements of each thread's chunk. A blocked call therefore matches
only where it puts no element in a scalar tail that eager computes with vectors, and
the reverse. :func:`_plan` checks that neither does: every thread chunk of eager's call
and of each block's call is a whole number of vector steps (ATen splits a GELU of more
than ``_SERIAL`` elements into ``get_num_threads()`` equal chunks); any other call (a
row width or thread count that does not divide, small, strided inputs) runs eager's
expression as it is.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ditops.kernels.cpu import blocks
from ditops.kernels.opaque import opaque_op

#: Bytes of the sum per block (stays in L2 with the output block).
_BLOCK_BYTES = 1024 * 1024
#: A multiple of every ATen vector step on CPU: two 64-byte vectors (AVX-512) per step.
_STEP_BYTES = 128
#: ATen's GELU runs on one thread up to this many elements (GELU_MIN_ELEMENTS_FOR_MULTI_THREADING).
_SERIAL = 16384


def _whole_steps(n: int, threads: int, step: int) -> bool:
    """Whether a GELU call on ``n`` contiguous elements has no scalar tail in any chunk."""
    chunk = n if n <= _SERIAL else -(-n // threads)
    return chunk % step == 0 and n % step == 0


def _plan(rows: torch.Tensor, dtype: torch.dtype) -> int | None:
    """Rows per block, or None where blocks would not give eager's bits (or gain nothing)."""
    R, C = rows.shape
    n, step, threads = R * C, _STEP_BYTES // dtype.itemsize, torch.get_num_threads()
    per = max(1, _BLOCK_BYTES // (C * dtype.itemsize))
    unit = threads * step // math.gcd(C, threads * step)  # rows whose GELU splits evenly
    per = per // unit * unit
    if per == 0 or R <= per or not _whole_steps(n, threads, step):
        return None
    last = R % per
    ok = _whole_steps(per * C, threads, step) and (
        not last or _whole_steps(last * C, threads, step)
    )
    return per if ok else None


def _rows(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` as a ``[R, C]`` view of rows in memory order (eager's sum is then contiguous)."""
    C = x.shape[-1]
    if x.dim() == 0 or x.numel() == 0 or x.stride(-1) != 1:
        return None
    try:
        rows = x.view(-1, C)
    except RuntimeError:
        return None
    return rows if rows.shape[0] == 1 or rows.stride(0) >= C else None


@opaque_op("ditops::cpu_gelu_tanh_bias")
def gelu_tanh_bias(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.gelu((x + bias).to(x.dtype), approximate="tanh")``, bitwise (``bias`` 1-D or
    None: then eager's one pass, nothing to fuse)."""
    if bias is None:
        return F.gelu(x, approximate="tanh")
    rows = _rows(x)
    per = None if rows is None else _plan(rows, x.dtype)
    if per is None:
        return F.gelu((x + bias).to(x.dtype), approximate="tanh")
    out = torch.empty(rows.shape, dtype=x.dtype)
    with blocks.scratch() as scratch:
        tmp = scratch.take(0, per, rows.shape[1], x.dtype)
        for r0 in range(0, rows.shape[0], per):
            src, dst = rows[r0 : r0 + per], out[r0 : r0 + per]
            t = tmp[: src.shape[0]]
            torch.add(src, bias, out=t)
            torch._C._nn.gelu(t, approximate="tanh", out=dst)
    return out.view(x.shape)


@gelu_tanh_bias.register_fake
def _(x, bias):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)
