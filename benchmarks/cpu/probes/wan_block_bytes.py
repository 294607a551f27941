"""Block size of the exact Wan kernels (one intra-op thread) at the bench shape.

bf16 ``[1, 8064, 1536]``, fp32 ``[1, 1, C]`` modulation: ``layer_norm_scale_shift`` and
``scale_residual_layer_norm_scale_shift`` (the norm3 call: gate 1, scale/shift) with
``kernels.cpu.modulation._BLOCK_BYTES`` set per variant, ``qk_norm_rope`` (12 heads of
128, across heads) with ``kernels.cpu.qk_norm_rope._BLOCK_BYTES``, ``fp32_layer_norm``
with ``kernels.cpu.layer_norm._BLOCK_BYTES``; exact precision, tuner off, variants
interleaved per round; median ms and median per-round ratio to the current size.

    PYTHONPATH=src python benchmarks/cpu/probes/wan_block_bytes.py [--rounds 9]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import ditops
from ditops import config
from ditops.kernels.cpu import layer_norm, modulation, qk_norm_rope

SIZES_KIB = (256, 512, 1024, 2048, 4096)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=9)
    a = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    L, C = 8064, 1536
    h, x = (torch.randn(1, L, C, generator=gen).to(torch.bfloat16) for _ in range(2))
    s, t = (torch.randn(1, 1, C, generator=gen) * 0.1 for _ in range(2))
    q, k = (torch.randn(1, L, 12, 128, generator=gen).to(torch.bfloat16) for _ in range(2))
    wq, wk = (torch.randn(C, generator=gen).to(torch.bfloat16) * 0.3 + 1 for _ in range(2))
    ang = torch.rand(L, 64, generator=gen) * 6.28
    cos, sin = ang.cos(), ang.sin()
    calls = {
        "ln_mod": (modulation, lambda: ditops.layer_norm_scale_shift(h, None, None, s, t, 1e-6)),
        "fused": (modulation, lambda: ditops.scale_residual_layer_norm_scale_shift(h, x, 1, None, None, s, t, 1e-6)),
        "qk": (qk_norm_rope, lambda: ditops.qk_norm_rope(q, k, wq, wk, cos, sin, 1e-6, across_heads=True)),
        "fp32_ln": (layer_norm, lambda: ditops.fp32_layer_norm(h, (C,), None, None, 1e-6)),
    }  # fmt: skip
    print(f"load {os.getloadavg()[0]:.2f}, torch threads {torch.get_num_threads()}")
    for name, (mod, call) in calls.items():
        base = mod._BLOCK_BYTES
        secs: dict[int, list[float]] = {k: [] for k in SIZES_KIB}
        with torch.inference_mode(), config.override(precision="exact", tune="off"):
            for r in range(a.rounds + 1):
                order = SIZES_KIB if r % 2 else SIZES_KIB[::-1]
                for kib in order:
                    mod._BLOCK_BYTES = kib << 10
                    t0 = time.perf_counter()
                    call()
                    if r:
                        secs[kib].append(time.perf_counter() - t0)
        mod._BLOCK_BYTES = base
        ref = secs[base >> 10]
        cells = "  ".join(
            f"{k}K {statistics.median(v) * 1e3:5.1f}ms {statistics.median(b / x for b, x in zip(ref, v)):4.2f}x"
            for k, v in secs.items()
        )
        print(f"{name:7} now {base >> 10}K load {os.getloadavg()[0]:.2f}  {cells}", flush=True)


if __name__ == "__main__":
    main()
