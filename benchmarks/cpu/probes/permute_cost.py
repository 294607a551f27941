"""Cost of the permuted mode's clustering and estimate against dense SDPA (issue 28).

``PYTHONPATH=src python benchmarks/cpu/probes/permute_cost.py [--rounds 3]``

[1, 12, 8192, 128] bf16 (scattered semantic attention, 32 frames of 16 x 16 tokens, the
first frame's 2 blocks kept in place), per round and interleaved: dense SDPA; the
clustering from a cold start (3 k-means rounds + the per-head order choice), warm (one
round from the previous step's centroids: every sparse step after the first); the
sampled estimate (4 rows per block) on the permuted q, k; the same estimate in the video
order (today's cost); the permutation gathers (q, k, v in, the output back). Prints each
as a share of dense SDPA (median over rounds) with the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from ditops.attention.permute import choose_heads, cluster_permutation
from ditops.bench.video_attention import scattered_attention
from ditops.ops.estimate_block_mask import estimate_block_mask


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    q, k, v = scattered_attention(32, 16, 16, heads=12, dim=128, dtype=torch.bfloat16)
    fixed, keep = 256, 0.25
    opts = {"keep_ratio": keep, "dense_blocks": 2, "method": "sampled"}
    with torch.inference_mode():
        first = choose_heads(q, k, cluster_permutation(q, k, fixed=fixed), block_size=128,
                             keep=keep)  # fmt: skip
        qp, kp = first.permute_q(q), first.permute_kv(k)

        def gathers() -> None:
            first.unpermute(first.permute_q(q))
            first.permute_kv(k)
            first.permute_kv(v)

        variants = {
            "dense SDPA": lambda: F.scaled_dot_product_attention(q, k, v),
            "cluster cold + choice": lambda: choose_heads(
                q, k, cluster_permutation(q, k, fixed=fixed), block_size=128, keep=keep
            ),
            "cluster warm": lambda: cluster_permutation(q, k, fixed=fixed, previous=first),
            "estimate permuted": lambda: estimate_block_mask(qp, kp, **opts),
            "estimate video order": lambda: estimate_block_mask(q, k, **opts),
            "permutation gathers": gathers,
        }
        times: dict[str, list[float]] = {name: [] for name in variants}
        for fn in variants.values():
            fn()  # warm-up
        for r in range(args.rounds):
            for name, fn in variants.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
            print(f"round {r}: load {os.getloadavg()}", flush=True)
    dense = statistics.median(times["dense SDPA"])
    print(f"dense SDPA median {dense * 1e3:.0f} ms; shares of it (median over rounds):")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:<24} {med * 1e3:9.1f} ms  {med / dense:7.2%}")
    warm = statistics.median(times["cluster warm"]) + statistics.median(times["estimate permuted"])
    print(f"  warm clustering + estimate: {warm / dense:.2%} of dense SDPA")
    print(f"load {os.getloadavg()}")


if __name__ == "__main__":
    main()
