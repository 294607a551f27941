"""The bench Wan's forward, norms-only exact patch against unpatched, quiet and busy.

The ``ditops bench wan`` model (dim 1536, 12 heads, 2 layers, bf16) at its small size
(21 x 16 x 24 = 8064 video tokens, 512 text tokens): ``unpatched`` and the norms-only
exact patch (``ditops.patch(model, precision="exact")``) under three threading models of
the blocked kernels: ``workers`` (blocks handed out to the calling thread and a helper,
:mod:`ditops.kernels.cpu.workers`, the default), ``1 thread`` (every block on the calling
thread, one intra-op thread: issue 26) and ``omp 2t`` (every block on the calling thread
with the process's intra-op threads: before issue 26). Variants take turns within each
round; per phase (quiet, then with a spinning process started for it) the median over
rounds of unpatched time / variant time in that round, and the ratio of best times. Load
average printed per phase.

    PYTHONPATH=src python benchmarks/cpu/probes/wan_norms_busy.py [--rounds 3] [--tune off]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from collections.abc import Callable

import torch

from ditops import config
from ditops.bench.harness import cpu_features
from ditops.bench.load import (
    blocked_kernel_threads,
    blocked_kernel_workers,
    busy_neighbour,
    header,
    ratios_to,
)
from ditops.bench.wan import LATENTS, TEXT_TOKENS
from ditops.bench.wan_model import build_model, make_inputs
from ditops.integrations import patch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tune", choices=config.TUNE_MODES, default="off")
    parser.add_argument("--phases", default="quiet,busy")
    args = parser.parse_args()
    print("\n".join(header()))
    print(f"cpu: {cpu_features()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}")
    print(f"command: {' '.join(sys.argv)}  (DITOPS_TUNE={args.tune})")
    dev, dt = torch.device("cpu"), torch.bfloat16
    base = build_model(None, dev, dt)
    inputs = make_inputs(base.config, LATENTS["small"][2:], TEXT_TOKENS, dev, dt)
    patched = copy.deepcopy(base)
    patch(patched, precision="exact")

    def fwd(
        model: torch.nn.Module, threads: int | None, workers: int | None
    ) -> Callable[[], object]:
        def run() -> object:
            with (
                torch.inference_mode(),
                blocked_kernel_threads(threads),
                blocked_kernel_workers(workers),
                config.override(tune=args.tune),
            ):
                return model(**inputs, return_dict=False)[0]

        return run

    fns = {
        "unpatched": fwd(base, None, None),
        "workers": fwd(patched, 1, None),
        "1 thread": fwd(patched, 1, 1),
        "omp 2t": fwd(patched, None, 1),
    }
    ref = fns["unpatched"]()
    for name, fn in fns.items():
        assert torch.equal(fn(), ref), name  # exact: the same bits
    names = " ".join(f"{n:>16}" for n in fns if n != "unpatched")
    print(f"{'phase':5} {'load':>5} {'unpatched s':>11} {names}")
    for phase in args.phases.split(","):
        with busy_neighbour(phase == "busy"):
            load = os.getloadavg()[0]
            res = ratios_to("unpatched", fns, args.rounds, warmup=0)
        cells = " ".join(f"{res[n][0]:7.2f}/{res[n][1]:7.2f}x" for n in fns if n != "unpatched")
        print(f"{phase:5} {load:5.2f} {res['unpatched'][2]:11.2f} {cells}", flush=True)


if __name__ == "__main__":
    main()
