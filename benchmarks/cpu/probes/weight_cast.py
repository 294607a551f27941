"""What casting FP32LayerNorm's weight and bias per call costs (issue 10.1: no fp32 cache).

    python benchmarks/cpu/probes/weight_cast.py

bf16 [5120] weight and bias to fp32, 1000 calls, against FP32LayerNorm on bf16
[8192, 5120] (5 calls), in one process.
"""

from __future__ import annotations

import time

import torch

from ditops import FP32LayerNorm

w, b = torch.randn(5120).bfloat16(), torch.randn(5120).bfloat16()
x = torch.randn(8192, 5120).bfloat16()
norm = FP32LayerNorm(5120).bfloat16()
with torch.inference_mode():
    for _ in range(3):
        w.float(), b.float()
    t = time.perf_counter()
    for _ in range(1000):
        w.float(), b.float()
    cast = (time.perf_counter() - t) / 1000
    norm(x)
    t = time.perf_counter()
    for _ in range(5):
        norm(x)
    call = (time.perf_counter() - t) / 5
print(
    f"cast of weight+bias [5120] bf16->fp32: {cast * 1e6:.1f} us per call; FP32LayerNorm bf16 "
    f"[8192, 5120]: {call * 1e3:.1f} ms per call ({cast / call * 100:.3f}%)"
)
