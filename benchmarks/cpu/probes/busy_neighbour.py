"""CPU paths against their meaning, quiet and with a busy neighbour, at Wan and FLUX sizes.

Per case, one run interleaves (round by round, each variant once per round, the order
alternating): the meaning (``native``); the meaning again as if it were a contender
(``A/A``: its ratio is the run's noise floor, the allocator's page state included); the
CPU path called directly with every block on the calling thread and the process's
intra-op threads (``path 2t``, the kernels before issue 26), every block on the calling
thread with one (``path 1t``, issue 26's), and its blocks shared with a helper thread
(``path wk``, :mod:`ditops.kernels.cpu.workers`, the default now); and the op as a user
calls it with ``DITOPS_TUNE=on`` (``tuned``: its first call, in the warm-up, times the paths and the
meaning and keeps the fastest). Each case first quiet, then with a spinning process
started for that phase (``busy``). Cells: median of per-round ratios to the meaning /
ratio of best times (>1: faster than the meaning). Load average per phase.

Cases: every op of ``op_costs.py --model wan`` and ``--model flux`` (their shapes), in
each precision of ``--precisions``; the estimate and block-sparse attention at Wan's
attention (``attention_cases``; fast only, as their paths).

The op-level memory-bound cases (FLUX's adaLN ops: 28 MB per tensor) swing with glibc's
heap: a freed block at the top of the heap is returned to the system past the trim
threshold, and the next call faults its pages in again. ``MALLOC_TRIM_THRESHOLD_`` and
``MALLOC_MMAP_THRESHOLD_`` set high (a steady heap, as in a process holding a model)
remove that swing; run both states.

    PYTHONPATH=src python benchmarks/cpu/probes/busy_neighbour.py [--rounds 7] [--only wan]
"""

from __future__ import annotations

# ruff: noqa: B023 - every closure runs inside the loop iteration that made it
import argparse
import os
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import torch

from ditops import config
from ditops.bench.load import (
    blocked_kernel_threads,
    blocked_kernel_workers,
    busy_neighbour,
    header,
    ratios_to,
)
from ditops.core import tune


def cases(only: str | None, precisions: tuple[str, ...]) -> Iterator[tuple[str, str, Any, Any]]:
    """(name, precision, op, prepared call): every op the Wan and FLUX patches run, at the
    shapes of ``op_costs.py`` (one definition of the shapes for both probes)."""
    from op_costs import flux_ops, wan_ops

    gen = torch.Generator().manual_seed(0)
    models = {"wan": wan_ops, "flux": flux_ops}
    for model, make in models.items():
        if only not in (None, model):
            continue
        for name, (fn, args, kw, _moved) in make(gen).items():
            op = fn.op  # public ops are functions; the module is fn.op
            for precision in precisions:
                yield f"{model} {name}", precision, op, op.prepare(*args, **kw)
    if only in (None, "attention") and "fast" in precisions:  # their paths are fast-only
        yield from attention_cases()


def attention_cases() -> Iterator[tuple[str, str, Any, Any]]:
    """The sparse ops at Wan's attention (21 x 16 x 24 tokens, 12 heads of 128, bf16, the
    video-like generator's q/k/v): the estimate at keep 0.25 with the first frame forced,
    and block-sparse attention on that mask (its meaning: masked dense attention)."""
    from ditops.bench.video_attention import SHAPES, video_attention
    from ditops.ops.block_sparse_attention import block_sparse_attention
    from ditops.ops.estimate_block_mask import estimate_block_mask

    frames, h, w = SHAPES["wan"]
    q, k, v = video_attention(frames, h, w, dtype=torch.bfloat16)
    est = estimate_block_mask.op.prepare(q, k, keep_ratio=0.25, dense_blocks=-(-h * w // 128))
    mask, counts = estimate_block_mask.op.forward_native(est)
    yield "wan estimate_block_mask", "fast", estimate_block_mask.op, est
    bsa = block_sparse_attention.op
    yield "wan block_sparse_attention", "fast", bsa, bsa.prepare(q, k, v, mask, counts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--only", choices=("wan", "flux", "attention"), default=None)
    parser.add_argument("--ops", default="", help="comma-separated substrings of case names")
    parser.add_argument("--precisions", default="exact,fast", help="comma-separated")
    parser.add_argument("--phases", default="quiet,busy", help="comma-separated: quiet, busy")
    args = parser.parse_args()
    print("\n".join(header()))
    print(f"command: {' '.join(sys.argv)}")
    print("cells: median of per-round ratios to the meaning / ratio of best times")
    names = ("A/A", "path 2t", "path 1t", "path wk", "tuned")
    print(
        f"{'case':30} {'prec':5} {'phase':5} {'load':>5} {'native ms':>9} "
        + " ".join(f"{n:>13}" for n in names)
    )
    print("(the tuned variant's cache: a fresh folder per case and phase)")
    with torch.inference_mode():
        precisions = tuple(args.precisions.split(","))
        phases = [p == "busy" for p in args.phases.split(",")]
        for name, precision, op, call in cases(args.only, precisions):
            if args.ops and not any(o in name for o in args.ops.split(",")):
                continue
            shape = "x".join(map(str, call.tensors()[0].shape))
            for busy in phases:
                tune.forget()  # each phase tunes afresh, in its own conditions
                tuned_cfg = config.replace(config.get(), tune="on", cache_dir=tempfile.mkdtemp())
                with busy_neighbour(busy), config.override(precision=precision):
                    load = os.getloadavg()[0]

                    def path(n: int | None, workers: int | None = 1) -> Any:
                        def run() -> object:
                            with blocked_kernel_threads(n), blocked_kernel_workers(workers):
                                return op.forward_cpu(call)

                        return run

                    here = config.replace(tuned_cfg, precision=precision)

                    def tuned() -> object:  # this thread's settings: tuning on, own cache
                        saved = getattr(config._local, "override", None)
                        config._local.override = here
                        try:
                            return op.run(call)
                        finally:
                            config._local.override = saved

                    variants = {
                        "native": lambda: op.forward_native(call),
                        "A/A": lambda: op.forward_native(call),
                        "path 2t": path(None),
                        "path 1t": path(1),
                        "path wk": path(1, None),
                        "tuned": tuned,
                    }
                    res = ratios_to("native", variants, args.rounds, warmup=2)
                phase = "busy" if busy else "quiet"
                cells = " ".join(f"{res[n][0]:6.2f}/{res[n][1]:6.2f}" for n in names)
                print(
                    f"{name:30} {precision:5} {phase:5} {load:5.2f} "
                    f"{res['native'][2] * 1e3:9.1f} {cells}   [{shape}]",
                    flush=True,
                )
                for c in tune.choices(tuned_cfg).values():
                    print(f"{'':36} tuned -> {c.winner.removeprefix('forward_')}: {c.why()}")


if __name__ == "__main__":
    main()
