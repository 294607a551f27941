"""gelu_tanh_bias on CPU: the meaning (two passes) against ditops' blocks, torch.compile
of the meaning, and a copy of the same bytes; bf16 [4096, C], C = 13824 and 8960 (Wan).

    python benchmarks/cpu/probes/gelu.py          # 2 threads (the machine's), then 1

Bytes per element (bf16): the meaning reads x and writes x + bias (4), then reads it and
writes the output (4): 8; the blocks read x and write the output: 4, as a copy (clone of
x) does. The parts are timed too: the add alone and the GELU alone (on a ready sum).
Milliseconds, min / median of 9 runs after 2 warm-ups (the machine is shared: the min
is the closest to an idle machine).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "src"))

import torch
import torch.nn.functional as F

import ditops


def meaning(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.gelu(x + b, approximate="tanh")


def ms(fn, *args, reps: int = 9) -> str:
    for _ in range(2):
        fn(*args)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return f"{1e3 * min(times):.0f}/{1e3 * statistics.median(times):.0f}"


def main() -> None:
    torch.manual_seed(0)
    compiled = torch.compile(meaning, dynamic=False)
    print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}")
    for threads in (torch.get_num_threads(), 1):
        torch.set_num_threads(threads)
        print(f"{threads} thread(s), load {os.getloadavg()[0]:.2f}")
        run(compiled)


def run(compiled) -> None:
    with torch.inference_mode(), ditops.override(precision="exact"):
        for c in (13824, 8960):
            x = torch.randn(4096, c).to(torch.bfloat16)
            b = torch.randn(c).to(torch.bfloat16)
            h = x + b
            assert torch.equal(ditops.gelu_tanh_bias(x, b), meaning(x, b))
            t0 = time.perf_counter()
            compiled(x, b)
            first = time.perf_counter() - t0
            row = {
                "copy": ms(torch.clone, x),
                "add alone": ms(torch.add, x, b),
                "gelu alone": ms(lambda t: F.gelu(t, approximate="tanh"), h),
                "meaning": ms(meaning, x, b),
                "ditops": ms(ditops.gelu_tanh_bias, x, b),
                "compile": ms(compiled, x, b),
            }
            mb = x.numel() * 2 / 2**20
            cells = ", ".join(f"{k} {v}" for k, v in row.items())
            print(f"[4096, {c}] bf16 ({mb:.0f} MiB): {cells} ms "
                  f"(compile's first call {first:.1f} s)")  # fmt: skip


if __name__ == "__main__":
    main()
