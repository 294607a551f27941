"""Mask quality (no timing) of every estimate method on every generator shape, keep 0.25.

What ``ditops bench masks --size full`` puts in its quality columns, without timing each
variant: the video-like attention of :mod:`ditops.bench.video_attention` on its four
shapes (Wan's 21 x 16 x 24 and three that no test was tuned on), 12 heads of 128, bf16,
the first frame forced; per method and ``samples`` (sampled methods), the mass kept over
both oracles and the output error over the per-row oracle mask's.

Run: ``PYTHONPATH=src python benchmarks/cpu/probes/masks_shapes.py`` (a few minutes);
``--keep 0.15 --methods sampled,sampled_head,sampled_layer`` for other densities.
"""

from __future__ import annotations

import torch

from ditops.bench.masks import MaskReference
from ditops.bench.video_attention import SHAPES, video_attention
from ditops.ops.estimate_block_mask import estimate_block_mask

RUNS = [("sampled", 1), ("sampled", 2), ("sampled", 4), ("sampled", 8), ("sampled_head", 4),
        ("sampled_layer", 4),
        ("antidiagonal", 4), ("antidiagonal_head", 4)]  # fmt: skip
KEEP = 0.25


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keep", type=float, default=KEEP)
    p.add_argument("--methods", default="", help="comma-separated; default: every run")
    args = p.parse_args()
    wanted = set(filter(None, args.methods.split(",")))
    runs = [(m, s) for m, s in RUNS if not wanted or (m in wanted and (s == 4 or m != "sampled"))]
    print(f"keep {args.keep}")
    print(f"{'shape':<14} {'S':>5} {'method':<18} {'samples':>7} {'/row or':>7} {'/head or':>8} "
          f"{'worst r':>7} {'rel err':>7} {'err/or':>6}")  # fmt: skip
    for name, shape in SHAPES.items():
        q, k, v = video_attention(*shape, dtype=torch.bfloat16)
        ref = MaskReference.of(q, k, v, shape)
        with torch.inference_mode():
            for method, samples in runs:
                mask, _ = estimate_block_mask(
                    q, k, keep_ratio=args.keep, dense_blocks=ref.first_frame, method=method,
                    samples=samples,
                )  # fmt: skip
                r = ref.quality(mask)
                shown = samples if method.startswith("sampled") else "-"
                print(f"{name + ' ' + 'x'.join(map(str, shape)):<14} {q.shape[2]:>5} "
                      f"{method:<18} {shown:>7} {r.mass_vs_row:>7.3f} {r.mass_vs_head:>8.3f} "
                      f"{r.worst_head_vs_row:>7.3f} {r.rel_err:>7.4f} "
                      f"{r.err_vs_row_oracle:>6.2f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
