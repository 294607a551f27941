"""Median time of the exact CPU LayerNorm per block size (bf16 [8192, 5120])."""

import time

import torch
import torch.nn.functional as F

import ditops.kernels.cpu.layer_norm as k

R, C = 8192, 5120
x = torch.randn(R, C).bfloat16()
w = torch.randn(C)
b = torch.randn(C)


def tm(f, n=9):
    f()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return round(sorted(ts)[n // 2] * 1e3, 1)


print(
    "clone",
    tm(lambda: x.clone()),
    "native",
    tm(lambda: F.layer_norm(x.float(), [C], w, b, 1e-6).to(x.dtype)),
    "mixed",
    tm(lambda: F.layer_norm(x, [C], w, b, 1e-6)),
)
for kb in (128, 256, 512, 1024, 2048, 4096):
    k._BLOCK_BYTES = kb * 1024
    print(kb, "KiB exact", tm(lambda: k.fp32_layer_norm(x, [C], w, b, 1e-6, True)))
