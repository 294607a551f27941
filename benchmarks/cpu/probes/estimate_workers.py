"""The sampled estimate's fp32 scores: 2-thread ATen calls vs one head per worker (issue 39).

``PYTHONPATH=src python benchmarks/cpu/probes/estimate_workers.py [--rounds 7]``

[1, 12, 8192, 128] bf16, 4 sampled rows per block, interleaved per round: dense SDPA; the
fp32 scores as :func:`ditops.attention.methods.sampled_block_scores_fp32` computes them
(one head at a time, each ATen call on the process's threads); the same arithmetic with
the heads handed to worker threads (:mod:`ditops.kernels.cpu.sampled_scores`); and the
whole estimate op as dispatched. Prints medians, each as a share of dense SDPA, and the
load average per round.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.nn.functional as F

from ditops.attention.methods import sample_rows, sampled_block_scores_fp32
from ditops.bench.harness import interleaved
from ditops.kernels.cpu.sampled_scores import sampled_block_scores_fp32 as per_worker
from ditops.ops.estimate_block_mask import estimate_block_mask


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args()
    torch.manual_seed(0)
    q = torch.randn(1, 12, args.tokens, 128, dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    scale = 128**-0.5
    opts = {"block_size": 128, "samples": 4, "scale": scale, "causal": False}

    def workers_form() -> torch.Tensor:
        rows = sample_rows(args.tokens, 128, 4)
        qs = q.index_select(2, rows).float() * scale
        return per_worker(qs, k, None, block_size=128, samples=4, kv_blocks=args.tokens // 128)

    variants = {
        "dense SDPA": lambda: F.scaled_dot_product_attention(q, k, v),
        "fp32 scores, 2-thread calls": lambda: sampled_block_scores_fp32(q, k, **opts),
        "fp32 scores, head per worker": workers_form,
        "estimate op (sampled)": lambda: estimate_block_mask(
            q, k, keep_ratio=0.25, dense_blocks=2, method="sampled"
        ),
    }
    with torch.inference_mode():
        a, b = variants["fp32 scores, 2-thread calls"](), workers_form()
        print(f"max |difference| of the two fp32 forms: {float((a - b).abs().max()):.3g}")
        print(f"# load before: {os.getloadavg()}", flush=True)
        times = interleaved(variants, args.rounds)
        print(f"# load after: {os.getloadavg()}", flush=True)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    dense = med["dense SDPA"]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, medians of {args.rounds}")
    for name, m in med.items():
        print(f"  {name:<30} {m * 1e3:8.1f} ms  {m / dense:7.2%} of dense SDPA")
    print(f"load {os.getloadavg()}")


if __name__ == "__main__":
    main()
