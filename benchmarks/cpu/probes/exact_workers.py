"""The exact CPU kernels' threading models against their meaning, quiet and with a busy neighbour.

Issue 39, item 1. Per case, one run interleaves (round by round, the order alternating):
the meaning (``native``, eager PyTorch with the process's intra-op threads), the meaning
again (``A/A``: its ratio is the run's noise floor), ``torch.compile`` of the meaning
(``--compile``; not bitwise equal, shown for scale), and the exact CPU path called
directly under three threading models:

* ``1 thread``: every block on the calling thread, one intra-op thread (issue 26's fix:
  robust under load, one core idle when quiet);
* ``omp 2t``: every block on the calling thread with the process's intra-op threads (each
  ATen call an OpenMP region and barrier: the kernels before issue 26);
* ``workers``: the blocks handed out one at a time to the calling thread and a helper
  thread (:mod:`ditops.kernels.cpu.workers`, the default now).

Each case first quiet, then with a spinning process started for that phase (``busy``).
Cells: median of per-round ratios to the meaning / ratio of best times (>1: faster than
the meaning). Load average (1 min) printed per phase; the header gives the machine.
Every variant's output is checked bitwise against the meaning first.

Cases: the issue's headline sizes (``fp32_layer_norm`` bf16 [8192, 5120];
``layer_norm_scale_shift`` [1, 8192, 5120] bf16 with fp32 [1, 1, 5120] scale/shift) and
every norm op of the Wan and FLUX patches at their shapes (``op_costs.py``).

    PYTHONPATH=src python benchmarks/cpu/probes/exact_workers.py [--rounds 7] [--only headline]
"""

from __future__ import annotations

# ruff: noqa: B023 - every closure runs inside the loop iteration that made it
import argparse
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

import ditops
from ditops import config
from ditops.bench.load import (
    blocked_kernel_threads,
    blocked_kernel_workers,
    busy_neighbour,
    header,
    ratios_to,
)

EPS = 1e-6


def headline(gen: torch.Generator) -> dict[str, tuple[Any, tuple, dict, int]]:
    """The sizes issue 39 states its targets at."""
    x = torch.randn(8192, 5120, generator=gen).bfloat16()
    h = torch.randn(1, 8192, 5120, generator=gen).bfloat16()
    s, t = (torch.randn(1, 1, 5120, generator=gen) * 0.1 for _ in range(2))
    return {
        "fp32_layer_norm 8192x5120": (ditops.fp32_layer_norm, (x, (5120,), None, None, EPS), {}, 0),
        "layer_norm_scale_shift 8192x5120": (
            ditops.layer_norm_scale_shift, (h, None, None, s, t, EPS), {}, 0
        ),
    }  # fmt: skip


def cases(only: str | None) -> Iterator[tuple[str, Any, Any]]:
    sys.path.insert(0, os.path.dirname(__file__))
    from op_costs import flux_ops, wan_ops

    gen = torch.Generator().manual_seed(0)
    makers = {"headline": headline, "wan": wan_ops, "flux": flux_ops}
    for model, make in makers.items():
        if only not in (None, model):
            continue
        for name, (fn, args, kw, _moved) in make(gen).items():
            yield f"{model} {name}", fn.op, fn.op.prepare(*args, **kw)


def as_tuple(out: object) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--only", choices=("headline", "wan", "flux"), default=None)
    parser.add_argument("--ops", default="", help="comma-separated substrings of case names")
    parser.add_argument("--phases", default="quiet,busy", help="comma-separated: quiet, busy")
    parser.add_argument("--compile", action="store_true", help="add torch.compile(meaning)")
    args = parser.parse_args()
    print("\n".join(header()))
    print(f"command: {' '.join(sys.argv)}")
    print("cells: median of per-round ratios to the meaning / ratio of best times")
    names = ["A/A", *(["compile"] if args.compile else []), "1 thread", "omp 2t", "workers"]
    cols = " ".join(f"{n:>13}" for n in names)
    print(f"{'case':36} {'phase':5} {'load':>5} {'native ms':>9} {cols}")
    with torch.inference_mode(), config.override(precision="exact"):
        for name, op, call in cases(args.only):
            if args.ops and not any(o in name for o in args.ops.split(",")):
                continue

            def path(threads: int | None, workers: int | None) -> Callable[[], object]:
                def run() -> object:
                    with blocked_kernel_threads(threads), blocked_kernel_workers(workers):
                        return op.forward_cpu(call)

                return run

            variants: dict[str, Callable[[], object]] = {
                "native": lambda: op.forward_native(call),
                "A/A": lambda: op.forward_native(call),
            }
            if args.compile:
                # Each case compiles the same lambda's code with other objects: without
                # room for recompiles dynamo stops compiling after 8 and runs eagerly.
                torch._dynamo.config.recompile_limit = 1000
                torch._dynamo.config.accumulated_recompile_limit = 10000
                compiled = torch.compile(lambda: op.forward_native(call))
                variants["compile"] = compiled
            variants["1 thread"] = path(1, 1)
            variants["omp 2t"] = path(None, 1)
            variants["workers"] = path(1, None)
            ref = as_tuple(variants["native"]())
            for v in ("1 thread", "omp 2t", "workers"):
                got = as_tuple(variants[v]())
                assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True)), (name, v)
            for phase in args.phases.split(","):
                with busy_neighbour(phase == "busy"):
                    load = os.getloadavg()[0]
                    res = ratios_to("native", variants, args.rounds, warmup=2)
                cells = " ".join(f"{res[n][0]:6.2f}/{res[n][1]:6.2f}" for n in names)
                print(
                    f"{name:36} {phase:5} {load:5.2f} {res['native'][2] * 1e3:9.1f} {cells}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
