"""What the estimate costs against dense SDPA, per method, bf16 and fp32 [1, 12, 8192, 128].

Interleaved rounds (dense, then each estimate), medians of per-round ratios, wall and CPU
time of the process (on a shared machine the CPU time says what a call did). Inputs:
:func:`ditops.bench.video_attention.video_attention` on 32 frames of 16 x 16 tokens
(S = 8192, the issue's shape; the first frame 2 blocks), keep 0.25.

Run: ``PYTHONPATH=src python benchmarks/cpu/probes/estimate_cost.py [--rounds N]``
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from ditops.bench.video_attention import video_attention
from ditops.ops.estimate_block_mask import estimate_block_mask

METHODS = {
    "antidiagonal s8": {"method": "antidiagonal", "stride": 8},
    "antidiagonal s16": {"method": "antidiagonal", "stride": 16},
    "sampled 4": {"method": "sampled", "samples": 4},
    "sampled 2": {"method": "sampled", "samples": 2},
    "sampled_head 4": {"method": "sampled_head", "samples": 4},
}


def timed(fn) -> tuple[float, float]:
    t, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t, time.process_time() - c


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    args = parser.parse_args()
    print(
        f"threads {torch.get_num_threads()}, capability {torch.backends.cpu.get_cpu_capability()}"
    )
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        q, k, v = video_attention(32, 16, 16, dtype=dtype)  # [1, 12, 8192, 128]
        opts = {"keep_ratio": 0.25, "dense_blocks": 2}
        with torch.inference_mode():
            calls = {"dense": lambda: F.scaled_dot_product_attention(q, k, v)}
            for label, m in METHODS.items():
                calls[label] = lambda m=m: estimate_block_mask(q, k, **opts, **m)
            for fn in calls.values():
                fn()
            got: dict[str, list[tuple[float, float]]] = {n: [] for n in calls}
            for _ in range(args.rounds):
                for n, fn in calls.items():
                    got[n].append(timed(fn))
        dense = got.pop("dense")
        print(
            f"\n{name}: dense SDPA median {statistics.median(w for w, _ in dense):.3f} s wall, "
            f"{statistics.median(c for _, c in dense):.3f} s CPU"
        )
        print(f"{'estimate':<18} {'ms wall':>8} {'% dense':>8} {'ms CPU':>8} {'% dense CPU':>11}")
        for n, ts in got.items():
            wall = statistics.median(t[0] / d[0] for t, d in zip(ts, dense))
            cpu = statistics.median(t[1] / d[1] for t, d in zip(ts, dense))
            print(
                f"{n:<18} {1e3 * statistics.median(w for w, _ in ts):>8.1f} {100 * wall:>8.2f} "
                f"{1e3 * statistics.median(c for _, c in ts):>8.1f} {100 * cpu:>11.2f}"
            )


if __name__ == "__main__":
    main()
