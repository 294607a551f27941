"""Probe behind ``_BLOCK_BYTES`` in ditops/kernels/cpu/qk_norm_rope.py.

    python benchmarks/cpu/probes/qk_block_size.py [threads]

Times the fused prologue (exact and fast) at Wan's and FLUX's shapes, bf16, for several
block sizes (bytes of the fp32 block holding q and k rows), the sizes taking turns (A, B,
C, A, B, C, ...) so that machine noise spreads over all of them; prints medians relative
to a clone of the same bytes.
"""

import statistics
import sys
import time

import torch

from ditops import config
from ditops.kernels.cpu import qk_norm_rope as K
from ditops.ops.qk_norm_rope import qk_norm_rope

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
torch.set_num_threads(threads)
SIZES_KIB = (512, 1024, 2048, 4096, 8192)
REPS = 7
for name, L, H, across in (("wan", 8192, 12, True), ("flux", 4608, 24, False)):
    D = 128
    q, k = torch.randn(1, L, H, D).bfloat16(), torch.randn(1, L, H, D).bfloat16()
    n = H * D if across else D
    w = (torch.rand(n) + 0.5).bfloat16()
    ang = torch.rand(L, D // 2) * 6.28
    args = (q, k, w, w, ang.cos(), ang.sin(), 1e-6)
    both = torch.cat([q, k])
    times: dict[tuple[str, int], list[float]] = {}
    clone: list[float] = []
    with torch.inference_mode():
        for _ in range(REPS):
            t0 = time.perf_counter()
            both.clone()
            clone.append(time.perf_counter() - t0)
            for precision in ("exact", "fast"):
                for kib in SIZES_KIB:
                    K._BLOCK_BYTES = kib * 1024
                    with config.override(precision=precision):
                        t0 = time.perf_counter()
                        qk_norm_rope(*args, across_heads=across)
                        times.setdefault((precision, kib), []).append(time.perf_counter() - t0)
    c = statistics.median(clone) * 1e3
    print(f"{name} [1, {L}, {H}, {D}] bf16, {threads} threads, clone {c:.1f} ms")
    for (precision, kib), ts in times.items():
        m = statistics.median(ts) * 1e3
        print(f"  {precision:5s} {kib:5d} KiB: {m:7.1f} ms  ({c / m:.2f} of clone)")
