"""Cost of the permuted mode's clustering and estimate against dense SDPA (issue 28).

``PYTHONPATH=src python benchmarks/cpu/probes/permute_cost.py [--rounds 3]``

[1, 12, 8192, 128] bf16 (scattered semantic attention, 32 frames of 16 x 16 tokens, the
first frame's 2 blocks kept in place), per round and interleaved: dense SDPA; the
clustering from a cold start (3 k-means rounds + the per-head order choice), warm (one
round from the previous step's centroids: every sparse step after the first); the
sampled estimate (4 rows per block) on the permuted q, k; the same estimate in the video
order (today's cost); the permutation gathers (q, k, v in, the output back). The estimate
runs as the op dispatches it (on a CPU without AMX: the sampled scores in fp32 by matmul
and softmax, ``sampled_block_scores_fp32``) and, for comparison in the same run, as the
meaning (the flash-kernel scores in bf16: the code before that path, forced with
``config.override(custom_ops="-estimate_block_mask")``). Prints each as a share of dense
SDPA (median over rounds of wall time, and of this process's CPU time) with the load
average. On a shared machine ``--threads 1`` gives the steadier ratios: with two threads
and other work on the cores, every parallel region of the clustering's many small ops
waits (and spins) for a descheduled thread, which a single long SDPA call hardly does.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from ditops import config
from ditops.attention.permute import choose_heads, cluster_permutation
from ditops.bench.video_attention import scattered_attention
from ditops.ops.estimate_block_mask import estimate_block_mask


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's choice)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch threads {torch.get_num_threads()}")
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
            "estimate permuted, old": lambda: old_estimate(qp, kp),
            "estimate video order": lambda: estimate_block_mask(q, k, **opts),
            "permutation gathers": gathers,
        }
        times: dict[str, list[float]] = {name: [] for name in variants}
        cpu: dict[str, list[float]] = {name: [] for name in variants}
        for fn in variants.values():
            fn()  # warm-up
        for r in range(args.rounds):
            for name, fn in variants.items():
                t0, c0 = time.perf_counter(), time.process_time()
                fn()
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
            print(f"round {r}: load {os.getloadavg()}", flush=True)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    med_cpu = {name: statistics.median(ts) for name, ts in cpu.items()}
    dense, dense_cpu = med["dense SDPA"], med_cpu["dense SDPA"]
    print(f"dense SDPA median {dense * 1e3:.0f} ms wall, {dense_cpu * 1e3:.0f} ms CPU; "
          "shares of it (medians over rounds):")  # fmt: skip
    print(f"  {'':<24} {'ms wall':>9}  {'% dense':>7}  {'ms CPU':>9}  {'% dense':>7}")
    for name in variants:
        print(f"  {name:<24} {med[name] * 1e3:9.1f}  {med[name] / dense:7.2%}  "
              f"{med_cpu[name] * 1e3:9.1f}  {med_cpu[name] / dense_cpu:7.2%}")  # fmt: skip
    for est in ("estimate permuted", "estimate permuted, old"):
        warm = med["cluster warm"] + med[est]
        warm_cpu = med_cpu["cluster warm"] + med_cpu[est]
        print(f"  warm clustering + {est}: {warm / dense:.2%} of dense SDPA (wall), "
              f"{warm_cpu / dense_cpu:.2%} (CPU)")  # fmt: skip
    print(f"load {os.getloadavg()}")


def old_estimate(q: torch.Tensor, k: torch.Tensor) -> None:
    """The estimate as before the fp32 CPU path: the meaning (bf16 flash-kernel scores)."""
    with config.override(custom_ops="-estimate_block_mask"):
        estimate_block_mask(q, k, keep_ratio=0.25, dense_blocks=2, method="sampled")


if __name__ == "__main__":
    main()
