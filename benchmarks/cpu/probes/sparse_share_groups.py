"""The gathered block-sparse kernel with its groups on worker threads vs on the process's
threads, against dense SDPA (issue 39, item 4).

``PYTHONPATH=src python benchmarks/cpu/probes/sparse_share_groups.py [--rounds 5]``

[1, 12, 8064, 128] bf16 in Wan's geometry (the video-like generator's q/k/v) at keep 0.25:
a random mask (every row its own 16 key blocks: no pairs) and the layer's own estimate
(first frame forced). Variants, interleaved per round: dense SDPA; the kernel with
``SHARE_GROUPS`` (groups of 16 MiB handed to worker threads, one intra-op thread each)
and without (64 MiB groups, each copy and SDPA call on the process's threads), each
without and with pairs of query blocks (``PAIR_QUERY_BLOCKS``). Prints
medians, ``x dense`` and the load per round. Both variants give the same bits (checked).
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.nn.functional as F

import ditops.kernels.cpu.block_sparse_attention as K
from ditops.attention import BlockSparseConfig
from ditops.bench.harness import interleaved
from ditops.bench.video_attention import SHAPES, video_attention
from ditops.layers.sparse_attention import BlockSparseAttention


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    frames, h, w = SHAPES["wan"]
    dense_blocks = -(-(h * w) // 128)
    q, k, v = video_attention(frames, h, w, dtype=torch.bfloat16)
    nb = -(-q.shape[2] // 128)
    g = torch.Generator().manual_seed(0)
    random = torch.zeros(1, q.shape[1], nb, nb, dtype=torch.int8)
    random.scatter_(
        -1, torch.rand(1, q.shape[1], nb, nb, generator=g).argsort(-1)[..., : round(nb / 4)], 1
    )
    layer = BlockSparseAttention(BlockSparseConfig(sparsity=0.75), dense_blocks=dense_blocks)
    scale = q.shape[-1] ** -0.5
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"[1, 12, {q.shape[2]}, 128] bf16, keep 0.25, load {os.getloadavg()}")  # fmt: skip
    with torch.inference_mode():
        estimated, _ = layer._estimate(q, k, layout="BNSD", scale=None, dense_blocks=dense_blocks)
        for label, mask in (("random", random), ("estimator", estimated)):

            def kernel(share: bool, pairs: bool = False, mask=mask) -> torch.Tensor:
                K.SHARE_GROUPS, K.PAIR_QUERY_BLOCKS = share, pairs
                return K.gathered_block_sparse_attention(q, k, v, mask, scale, False, 128, False)

            same = torch.equal(kernel(True), kernel(False))
            variants = {
                "dense SDPA": lambda: F.scaled_dot_product_attention(q, k, v),
                "shared groups": lambda: kernel(True),
                "process threads": lambda: kernel(False),
                "shared, pairs": lambda: kernel(True, True),
                "process, pairs": lambda: kernel(False, True),
            }
            print(f"# load before: {os.getloadavg()}", flush=True)
            times = interleaved(variants, args.rounds)
            print(f"# load after: {os.getloadavg()}", flush=True)
            d = statistics.median(times["dense SDPA"])
            print(f"{label} mask, density {float(mask.float().mean()):.3f}, same bits: {same}")
            for name, ts in times.items():
                m = statistics.median(ts)
                print(f"  {name:<16} {m * 1e3:9.1f} ms  {d / m:5.2f}x dense", flush=True)
    K.SHARE_GROUPS, K.PAIR_QUERY_BLOCKS = True, False
    print(f"# load at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
