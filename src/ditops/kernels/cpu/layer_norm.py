"""FP32 LayerNorm on CPU: low-precision in and out, fp32 inside.

Memory model for bf16 [R, C] (bytes moved; the field notes measure what they cost):
the native meaning ``layer_norm(x.float()).to(bf16)`` makes three passes over memory
(an fp32 copy of x: read 2 + write 4 bytes; the norm: read 4 + write 4; the cast:
read 4 + write 2 bytes per element, 20 bytes in all) where a copy moves 4. So:

* ``exact``: the same three ATen calls on blocks of rows small enough that the fp32
  temporaries stay in L2. ATen normalises each row on its own, so the result is
  bitwise the native one; DRAM traffic drops to one read and one write of bf16. The
  fp32 copy of a block goes to this thread's scratch block, LayerNorm's own output is
  kept off fresh pages (:mod:`ditops.kernels.cpu.blocks`), and the cast writes into the
  output: no fresh memory per block in either state of glibc's allocator.
* ``fast``: ATen's mixed-dtype kernel (bf16/fp16 input, fp32 weights, fp32 math
  inside, one pass): within 1 bf16 ulp of native on a few elements in 1e5.

Both are registered as ``torch.library`` custom ops so ``torch.compile`` treats them
as opaque calls instead of unrolling the row loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from ditops.kernels.cpu import blocks, workers
from ditops.kernels.opaque import opaque_op

#: fp32 bytes per block of rows. Each ATen call on a block is one parallel region, so
#: blocks must not be too small either. Measured at bf16 [8192, 5120], 2 threads
#: (benchmarks/cpu/probes/ln_block_size.py, median of 9): 128 KiB 128 ms, 256 KiB 79 ms,
#: 512 KiB 68 ms, 1 MiB 67 ms, 2 MiB 69 ms, 4 MiB 63 ms; native 151 ms, clone 28 ms.
#: Preallocated buffers with native_layer_norm.out gained nothing (71-90 ms).
_BLOCK_BYTES = 1024 * 1024


#: ATen's mixed-dtype kernel computes the mean a little differently; on very short rows
#: (a row of one element, say) x - mean is then a tiny non-zero instead of 0, far more
#: than 1 ulp. Short rows gain nothing from it anyway.
_MIXED_MIN_ROW = 256


def _rows_per_block(row_len: int) -> int:
    return max(1, _BLOCK_BYTES // max(1, 4 * row_len))


@opaque_op("ditops::cpu_fp32_layer_norm")
def fp32_layer_norm(
    x: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    exact: bool,
) -> torch.Tensor:
    """``F.layer_norm(x.float(), shape, weight, bias, eps).to(x.dtype)`` on CPU.

    ``weight``/``bias`` must already be fp32 (or None). ``exact=True`` is bitwise equal
    to that expression; ``exact=False`` uses ATen's mixed-dtype kernel.
    """
    shape = list(normalized_shape)
    row_len = 1
    for d in shape:
        row_len *= d
    if x.dtype == torch.float32 or x.numel() == 0:
        return F.layer_norm(x, shape, weight, bias, eps)
    if not exact and row_len >= _MIXED_MIN_ROW:
        # bf16/fp16 input with fp32 (or no) affine parameters: one fused pass, fp32 inside.
        return F.layer_norm(x, shape, weight, bias, eps)
    rows = x.reshape(-1, row_len)
    n_rows = rows.shape[0]
    if n_rows <= _rows_per_block(row_len):
        # One block: its fp32 temporaries fit in L2 anyway, and the expression itself
        # (the same three ATen calls, the same bits) costs less than the block walk.
        return F.layer_norm(x.float(), shape, weight, bias, eps).to(x.dtype)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    w = None if weight is None else weight.reshape(row_len)
    b = None if bias is None else bias.reshape(row_len)
    step = min(_rows_per_block(row_len), n_rows)
    piece = blocks.piece_rows(n_rows, step, 4 * row_len)
    step = blocks.block_step(step, piece)
    n_blocks = -(-n_rows // step)

    def body(scratch: blocks.Scratch) -> Callable[[int], None]:
        full = scratch.take(0, step, row_len, torch.float32)

        def run(i: int) -> None:
            start = i * step
            src = rows[start : start + step]
            buf = full if src.shape[0] == step else full[: src.shape[0]]
            buf.copy_(src)  # the exact fp32 value of every element, as .float()
            # copy_ into out rounds to nearest even exactly as .to() does.
            blocks.layer_norm_into(out[start : start + step], buf, w, b, eps, piece)

        return run

    workers.run_blocks(n_blocks, body)
    return out.reshape(x.shape)


@fp32_layer_norm.register_fake
def _(x, normalized_shape, weight, bias, eps, exact):
    return torch.empty_like(x, memory_format=torch.contiguous_format)
