"""The estimate's share of a sparse attention forward, with mask reuse (issue 19).

One ``BlockSparseAttention`` layer at sparsity 0.75 on video-like attention (Wan's
21 x 16 x 24 latent, 8064 tokens, 12 heads of 128, first frame kept dense), for 8
denoising steps of one guidance branch, with ``estimate_every`` 1, 2 and 4: per forward,
the time of the layer, of its mask estimates, and their share; a dense SDPA call on the
same q/k/v in the same run for scale. Interleaved: each round runs every setting once.

    python benchmarks/cpu/probes/estimate_share.py [--dtype bfloat16] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F

from ditops.attention import BlockSparseConfig
from ditops.bench.video_attention import SHAPES, video_attention
from ditops.layers.sparse_attention import BlockSparseAttention

STEPS = 8


def timed_layer(
    every: int, dense_blocks: int, method: str
) -> tuple[BlockSparseAttention, list[float]]:
    cfg = BlockSparseConfig(sparsity=0.75, estimate_every=every, method=method)
    layer = BlockSparseAttention(cfg, dense_blocks=dense_blocks)
    spent: list[float] = []
    estimate = layer._estimate

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = estimate(*args, **kwargs)
        spent.append(time.perf_counter() - t0)
        return out

    layer._estimate = timed  # type: ignore[method-assign]
    return layer, spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--method", default="sampled")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    frames, h, w = SHAPES["wan"]
    q, k, v = video_attention(frames, h, w, dtype=dtype)
    dense_blocks = -(-(h * w) // 128)
    results: dict[int, dict[str, list[float]]] = {e: {"fwd": [], "est": []} for e in (1, 2, 4)}
    dense: list[float] = []
    with torch.inference_mode():
        # Untimed: the first sparse call compiles FlexAttention where the CPU path uses it.
        timed_layer(1, dense_blocks, args.method)[0](q, k, v, step=STEPS - 1, branch="cond")
        for _ in range(args.rounds):
            for _ in range(2):  # one dense call is easily disturbed on a shared machine
                t0 = time.perf_counter()
                F.scaled_dot_product_attention(q, k, v)
                dense.append(time.perf_counter() - t0)
            for every in (1, 2, 4):
                layer, spent = timed_layer(every, dense_blocks, args.method)
                t0 = time.perf_counter()
                for step in range(STEPS):
                    layer(q, k, v, step=step, branch="cond")
                total = time.perf_counter() - t0
                results[every]["fwd"].append(total / STEPS)
                results[every]["est"].append(sum(spent) / STEPS)
    print(
        f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, "
        f"{torch.get_num_threads()} threads, {args.dtype}, method {args.method!r}, "
        f"[1, 12, {q.shape[2]}, 128], sparsity 0.75, {STEPS} steps x {args.rounds} rounds"
    )
    d = statistics.median(dense)
    print(f"dense SDPA: {d * 1e3:.0f} ms")
    print(
        f"{'estimate_every':>15} {'forward ms':>11} {'estimate ms':>12} {'share':>6} "
        f"{'fwd/dense':>10} {'est/dense':>10}"
    )
    for every, r in results.items():
        fwd, est = statistics.median(r["fwd"]), statistics.median(r["est"])
        print(
            f"{every:>15} {fwd * 1e3:>11.0f} {est * 1e3:>12.0f} {est / fwd:>6.1%} {fwd / d:>10.2f}"
            f" {est / d:>10.1%}"
        )


if __name__ == "__main__":
    main()
