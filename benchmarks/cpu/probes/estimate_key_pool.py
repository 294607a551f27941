"""Cheaper sampled scores by thinning the keys: strided or mean-pooled keys (issue 19, negative).

The sampled estimate's cost is SDPA of ``samples`` rows per query block against every
key. Halving the keys halves it. Two ways, each swapped in for
``ditops.attention.methods.sampled_block_scores`` (the probe's own variant, not a library
option): ``stride s`` keeps every s-th key, ``pool s`` averages each run of s keys. Per
variant: the mask quality at keep 0.25 on the generator's four shapes (as
``masks_shapes.py``), then the estimate's time against dense SDPA on Wan's shape, bf16.

    PYTHONPATH=src python benchmarks/cpu/probes/estimate_key_pool.py [--no-quality]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

import ditops.attention.estimate as estimate_module
import ditops.attention.methods as methods
import ditops.ops.estimate_block_mask as op_module
from ditops.attention.block_mask import num_blocks
from ditops.bench.harness import interleaved
from ditops.bench.masks import MaskReference
from ditops.bench.video_attention import SHAPES, video_attention
from ditops.ops.estimate_block_mask import estimate_block_mask

ORIGINAL = methods.sampled_block_scores
VARIANTS = [("keys", 1), ("stride", 2), ("pool", 2), ("pool", 4)]
MODE: list[tuple[str, int]] = [("keys", 1)]


def thinned_scores(q, k, *, block_size, samples, scale, causal, compute_dtype=None):
    """The sampled scores against thinned keys (non-causal only: the probe's cases)."""
    how, s = MODE[0]
    if s == 1:
        return ORIGINAL(q, k, block_size=block_size, samples=samples, scale=scale,
                        causal=causal, compute_dtype=compute_dtype)  # fmt: skip
    assert not causal
    batch, heads, q_len, dim = (int(x) for x in q.shape)
    kv_len = int(k.shape[2])
    dtype = q.dtype if compute_dtype is None else compute_dtype
    q_blocks, kv_blocks = num_blocks(q_len, block_size), num_blocks(kv_len, block_size)
    rows = methods.sample_rows(q_len, block_size, samples)
    qs = q.index_select(2, rows).to(dtype)
    if how == "stride":
        pos = torch.arange(s // 2, kv_len, s)
        kk = k.index_select(2, pos).to(dtype)
    else:
        pos = torch.arange(0, kv_len - kv_len % s, s)
        kk = k[:, :, : len(pos) * s].float().unflatten(2, (len(pos), s)).mean(3).to(dtype)
    col_block = pos // block_size
    onehot = (col_block[:, None] == torch.arange(dim)).to(dtype)
    v = onehot.expand(batch, int(k.shape[1]), len(pos), dim)
    mass = F.scaled_dot_product_attention(qs, kk, v, scale=scale,
                                          enable_gqa=heads != int(k.shape[1]))  # fmt: skip
    mass = mass[..., :kv_blocks].float().reshape(batch, heads, q_blocks, samples, kv_blocks)
    return mass.sum(3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--no-quality", action="store_true")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    for mod in (methods, estimate_module, op_module):
        if hasattr(mod, "sampled_block_scores"):
            mod.sampled_block_scores = thinned_scores
    opts = {"keep_ratio": 0.25, "method": "sampled", "samples": 4}
    if not args.no_quality:
        print(f"{'shape':<6} {'keys':<9} {'/row or':>7} {'/head or':>8} {'worst r':>7} "
              f"{'err/or':>6}")  # fmt: skip
        for name, shape in SHAPES.items():
            q, k, v = video_attention(*shape, dtype=torch.bfloat16)
            ref = MaskReference.of(q, k, v, shape)
            with torch.inference_mode():
                for variant in VARIANTS:
                    MODE[0] = variant
                    mask, _ = estimate_block_mask(q, k, dense_blocks=ref.first_frame, **opts)
                    r = ref.quality(mask)
                    print(f"{name:<6} {variant[0] + ' ' + str(variant[1]):<9} "
                          f"{r.mass_vs_row:>7.3f} {r.mass_vs_head:>8.3f} "
                          f"{r.worst_head_vs_row:>7.3f} {r.err_vs_row_oracle:>6.2f}",
                          flush=True)  # fmt: skip
    q, k, v = video_attention(*SHAPES["wan"], dtype=torch.bfloat16)
    fns = {"dense": lambda: F.scaled_dot_product_attention(q, k, v)}
    for variant in VARIANTS:

        def run(variant=variant):
            MODE[0] = variant
            return estimate_block_mask(q, k, dense_blocks=3, **opts)

        fns[f"{variant[0]} {variant[1]}"] = run
    with torch.inference_mode():
        for fn in fns.values():
            fn()
        times = interleaved(fns, args.rounds)
    print(f"\nbf16 [1, 12, {q.shape[2]}, 128], sampled estimate (4 rows, keep 0.25) vs dense, "
          f"{args.rounds} interleaved rounds, medians of per-round ratios")  # fmt: skip
    for name, ts in times.items():
        share = statistics.median(t / d for t, d in zip(ts, times["dense"]))
        print(f"{name:<9} {statistics.median(ts) * 1e3:7.1f} ms {share:7.1%}")


if __name__ == "__main__":
    main()
