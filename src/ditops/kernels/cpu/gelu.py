"""``gelu(x + bias, approximate="tanh")`` on CPU, in x's dtype, bitwise eager's.

Memory model for bf16 ``[R, C]``: eager writes the sum ``x + bias`` to a temporary and
reads it back for the GELU, 8 bytes per element (read x 2, write 2, read 2, write the
output 2) where a copy moves 4. This kernel runs the same two ATen calls on small blocks
of rows (``torch.add(..., out=)`` into a scratch block that stays in cache, the GELU
written straight into the output): 4 bytes per element from memory.

Threads: each block's calls are small enough for ATen to run them on the calling thread
(no OpenMP region: on a loaded machine each region's barrier cost milliseconds, which
made 1 MiB blocks 3x slower than eager); ``torch.get_num_threads()`` Python threads
(ATen releases the GIL) take one range of rows each. Timings, and why the bytes saved
did not show as time on the project machine (its bf16 GELU is compute-bound, ~3x a
copy): benchmarks/cpu/probes/gelu.txt.

Why the blocks keep eager's bits: the sum is one IEEE addition per element (``out=``
rounds as ``.to`` does), but ATen's GELU gives other bits for some inputs in its scalar
loop than in its vector loop (tanh differs; ~7% of fp32 inputs), and it runs the scalar
loop on the last ``n mod (2 * lanes)`` elements of each chunk it hands a thread.
:func:`_plan` blocks a call only where eager's chunks (``get_num_threads()`` equal ones
above ``_SERIAL`` elements) and every block are whole vector steps: then no element is
scalar on either side. Any other call runs eager's expression as it is.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

from ditops.kernels.cpu import blocks
from ditops.kernels.opaque import opaque_op

#: A multiple of every ATen vector step on CPU: two 64-byte vectors (AVX-512) per step.
_STEP_BYTES = 128
#: ATen runs a GELU of at most this many elements on the calling thread
#: (GELU_MIN_ELEMENTS_FOR_MULTI_THREADING; its add stays serial below 32768): the most
#: elements per call, and the block size (32 KiB of bf16: the sum stays in L1/L2).
_SERIAL = 16384


#: Fewer blocks than this per thread: the calling thread does them all.
_MIN_BLOCKS_PER_THREAD = 8


def _rows(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` as a ``[R, C]`` view of rows in memory order (eager's sum is then contiguous)."""
    C = x.shape[-1] if x.dim() else 0
    if x.numel() == 0 or x.stride(-1) != 1:
        return None
    try:
        rows = x.view(-1, C)
    except RuntimeError:
        return None
    return rows if rows.shape[0] == 1 or rows.stride(0) >= C else None


def _plan(rows: torch.Tensor, dtype: torch.dtype) -> int | None:
    """Rows per block, or None where blocks would not give eager's bits (or gain nothing)."""
    R, C = rows.shape
    n, step = R * C, _STEP_BYTES // dtype.itemsize
    chunk = n if n <= _SERIAL else -(-n // torch.get_num_threads())
    if n <= 2 * _SERIAL or n % step or chunk % step:
        return None  # small, or eager runs a scalar tail somewhere
    unit = step // math.gcd(C, step)  # rows making whole vector steps
    return max(1, _SERIAL // (unit * C)) * unit


def _run(
    rows: torch.Tensor,
    bias: torch.Tensor,
    out: torch.Tensor,
    r0: int,
    r1: int,
    per: int,
    inference: bool,
) -> None:
    """Rows ``[r0, r1)``: the sum of a block into scratch, its GELU into ``out``, in
    pieces of at most ``_SERIAL`` elements (whole vector steps). Views are made up front
    (one call each): per block only the ATen calls run in Python."""
    C = rows.shape[1]
    with blocks.scratch() as scratch, torch.inference_mode(inference):
        tmp = scratch.take(0, per, C, rows.dtype)
        tmp_pieces = tmp.view(-1).split(_SERIAL)
        for src, dst in zip(rows[r0:r1].split(per), out[r0:r1].split(per)):
            if src.shape[0] == per:
                t, pieces = tmp, tmp_pieces
            else:
                t = tmp[: src.shape[0]]
                pieces = t.view(-1).split(_SERIAL)
            torch.add(src, bias, out=t)
            for p, d in zip(pieces, dst.view(-1).split(_SERIAL)):
                torch._C._nn.gelu(p, approximate="tanh", out=d)


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
    R, inference = rows.shape[0], torch.is_inference_mode_enabled()
    parts = max(1, min(torch.get_num_threads(), R // (_MIN_BLOCKS_PER_THREAD * per)))
    cuts = [R * i // parts // per * per for i in range(parts)] + [R]
    if parts == 1:
        _run(rows, bias, out, 0, R, per, inference)
        return out.view(x.shape)
    with ThreadPoolExecutor(parts - 1) as pool:
        rest = [
            pool.submit(_run, rows, bias, out, a, b, per, inference)
            for a, b in zip(cuts[1:-1], cuts[2:])
        ]
        _run(rows, bias, out, cuts[0], cuts[1], per, inference)
        for f in rest:
            f.result()  # a worker's error is raised here
    return out.view(x.shape)


@gelu_tanh_bias.register_fake
def _(x, bias):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)
