"""Where the in-budget estimator spends its budget: per query block row, or over each
head's whole block map? Quality of both at the same density, on video-like inputs.

Inputs: :func:`ditops.bench.attention.video_qk` at Wan's shape after patching, 21 latent
frames of 16 x 24 tokens (8064 tokens, 63 blocks of 128, the first frame 3 blocks),
12 heads of 128, random values; computed in fp32. For densities 0.5 / 0.25 / 0.15, with
the first frame, sink and recent blocks forced and paid from the budget:

* ``row``: ditops' selection (:func:`ditops.attention.estimate.select_in_budget`): the
  budget left after the forced blocks is split over the rows, each row keeps its share
  of top-scoring blocks;
* ``map``: the same budget per head, spent on the top-scoring blocks of the whole map
  (rows compete).

Each is also run on the exact block masses (its oracle). Printed per variant: realised
block density, softmax mass kept (share of all), mass kept over the oracle's, output
error against dense attention (relative L2 over everything, and the 99th percentile
and worst over query blocks of the per-block relative error: a starved row shows
there).

Run: ``PYTHONPATH=src python benchmarks/cpu/probes/budget_per_row_vs_map.py``
(a few minutes on 2 cores).
"""

from __future__ import annotations

import torch

from ditops.attention.estimate import block_scores
from ditops.attention.reference import block_sparse_attention_reference
from ditops.attention.selection import block_budget, forced_block_mask, select_in_budget
from ditops.bench.attention import exact_block_mass, video_qk

FRAMES, HEIGHT, WIDTH, BLOCK, STRIDE = 21, 16, 24, 128, 8
DENSE_BLOCKS = 3  # 384 first-frame tokens
FLAGS = {"keep_sink": True, "keep_recent": True, "causal": False}


def select_map(scores: torch.Tensor, keep_ratio: float) -> torch.Tensor:
    """Per head: the forced blocks, then the best remaining blocks of the whole map."""
    qb, kb = scores.shape[-2:]
    budget = block_budget(qb, kb, keep_ratio=keep_ratio, dense_blocks=DENSE_BLOCKS, **FLAGS)
    forced = forced_block_mask(qb, kb, dense_blocks=DENSE_BLOCKS, **FLAGS)
    left = budget.total - budget.forced
    v = scores.masked_fill(forced, -1.0).flatten(-2)
    keep = torch.zeros_like(v, dtype=torch.bool)
    keep.scatter_(-1, v.topk(left, dim=-1).indices, True)
    return keep.view(scores.shape) | forced


def select_row(scores: torch.Tensor, keep_ratio: float) -> torch.Tensor:
    return select_in_budget(
        scores, threshold=1.0, keep_ratio=keep_ratio, dense_blocks=DENSE_BLOCKS, **FLAGS
    )


def block_errors(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Relative L2 error per (head, query block)."""
    b, h, s, d = ref.shape
    diff = (out - ref).view(b, h, -1, BLOCK, d).norm(dim=(-1, -2))
    return (diff / ref.view(b, h, -1, BLOCK, d).norm(dim=(-1, -2))).flatten()


def main() -> None:
    torch.manual_seed(0)
    q, k = video_qk(FRAMES, HEIGHT, WIDTH, dtype=torch.float32)
    v = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    dim = q.shape[-1]
    with torch.inference_mode():
        dense = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        est = block_scores(
            q, k, block_size=BLOCK, stride=STRIDE, score_scale=dim**-0.5 / STRIDE, causal=False
        )
        mass = exact_block_mass(q, k)
    total = float(mass.sum())
    print(f"S={q.shape[2]}, heads={q.shape[1]}, first frame {DENSE_BLOCKS} blocks")
    print(
        f"{'density':>7} {'split':>5} {'scores':>6} {'realised':>8} {'mass kept':>9} "
        f"{'/oracle':>7} {'rel err':>8} {'p99 blk':>8} {'worst blk':>9}"
    )
    for keep_ratio in (0.5, 0.25, 0.15):
        results = {}
        for split, select in (("row", select_row), ("map", select_map)):
            oracle = select(mass, keep_ratio)
            for source, scores in (("est", est), ("exact", mass)):
                keep = select(scores, keep_ratio)
                mask = keep.to(torch.int8)
                with torch.inference_mode():
                    out = block_sparse_attention_reference(q, k, v, mask, block_size=BLOCK)
                errs = block_errors(out, dense)
                kept = float((mass * keep).sum())
                results[(split, source)] = (
                    float(keep.float().mean()),
                    kept / total,
                    kept / float((mass * oracle).sum()),
                    float((out - dense).norm() / dense.norm()),
                    float(errs.quantile(0.99)),
                    float(errs.max()),
                )
        for (split, source), r in results.items():
            print(
                f"{keep_ratio:>7.2f} {split:>5} {source:>6} {r[0]:>8.3f} {r[1]:>9.3f} "
                f"{r[2]:>7.3f} {r[3]:>8.4f} {r[4]:>8.4f} {r[5]:>9.4f}"
            )


if __name__ == "__main__":
    main()
