"""CPU paths against their meaning, quiet and with a busy neighbour, at Wan and FLUX sizes.

Per case, one run interleaves (round by round, each variant once per round, the order
alternating): the meaning (``native``); the CPU path called directly with the process's
intra-op threads (``path 2t``, ``blocks.THREADS = None``, the kernels before issue 26)
and with one (``path 1t``, ``blocks.THREADS = 1``, the default now); and the op as a
user calls it with ``DITOPS_TUNE=on`` (``tuned``: its first call, in the warm-up, times
path and meaning and keeps the faster). Each case first quiet, then with a spinning
process started for that phase (``busy``). Cells: median of per-round ratios to the
meaning / ratio of best times (>1: faster than the meaning). Load average per phase.

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
from ditops.bench.load import blocked_kernel_threads, busy_neighbour, header, ratios_to
from ditops.core import tune


def cases(only: str | None) -> Iterator[tuple[str, str, Any, Any]]:
    """(name, precision, op, prepared call)."""
    from ditops.ops import modulation_fp32 as m32
    from ditops.ops import modulation_model_dtype as mmd
    from ditops.ops.layer_norm import fp32_layer_norm as ln

    g = torch.Generator().manual_seed(0)

    def r(*s: int, dt: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*s, generator=g).to(dt)

    if only in (None, "wan"):
        L, C = 8064, 1536  # the bench Wan: 21 x 16 x 24 tokens, dim 1536
        h, a = r(1, L, C), r(1, L, C)
        sc, sh, gt = (r(1, 1, C, dt=torch.float32) * 0.1 for _ in range(3))
        w, b = r(C, dt=torch.float32), r(C, dt=torch.float32)
        fused = m32.scale_residual_layer_norm_scale_shift
        yield "wan ln_mod", "exact", m32.layer_norm_scale_shift, (h, None, None, sc, sh, 1e-6)
        yield "wan fused norm2", "exact", fused, (h, a, gt, w, b, None, None, 1e-6)
        yield "wan gated (ffn)", "exact", m32.gated_residual, (h, a.float(), gt)
        yield "FP32LayerNorm", "exact", ln, (h[0], (C,), w, b, 1e-6)
        yield "FP32LayerNorm", "fast", ln, (h[0], (C,), w, b, 1e-6)
    if only in (None, "flux"):
        L, C = 4096 + 512, 3072  # FLUX 1024px: 4096 image + 512 text tokens, dim 3072
        h, a = r(1, L, C), r(1, L, C)
        sc, sh, gt = (r(1, 1, C) * 0.1 for _ in range(3))
        yield "flux adaln_modulate", "exact", mmd.adaln_modulate, (h, sc, sh, 1e-6)
        yield "flux adaln_residual", "exact", mmd.adaln_residual, (h, a, gt)
        yield "flux adaln_modulate", "fast", mmd.adaln_modulate, (h, sc, sh, 1e-6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--only", choices=("wan", "flux"), default=None)
    args = parser.parse_args()
    print("\n".join(header()))
    print(f"command: {' '.join(sys.argv)}")
    print("cells: median of per-round ratios to the meaning / ratio of best times")
    names = ("path 2t", "path 1t", "tuned")
    print(
        f"{'case':20} {'prec':5} {'phase':5} {'load':>5} {'native ms':>9} "
        + " ".join(f"{n:>13}" for n in names)
    )
    print("(the tuned variant's cache: a fresh folder per case and phase)")
    with torch.inference_mode():
        for name, precision, fn, argv in cases(args.only):
            op = getattr(fn, "op", fn)  # public ops are functions; the module is fn.op
            call = op.prepare(*argv)
            shape = "x".join(map(str, argv[0].shape))
            for busy in (False, True):
                tune.forget()  # each phase tunes afresh, in its own conditions
                tuned_cfg = config.replace(config.get(), tune="on", cache_dir=tempfile.mkdtemp())
                with busy_neighbour(busy), config.override(precision=precision):
                    load = os.getloadavg()[0]

                    def path(n: int | None) -> Any:
                        def run() -> object:
                            with blocked_kernel_threads(n):
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
                        "path 2t": path(None),
                        "path 1t": path(1),
                        "tuned": tuned,
                    }
                    res = ratios_to("native", variants, args.rounds, warmup=2)
                phase = "busy" if busy else "quiet"
                cells = " ".join(f"{res[n][0]:6.2f}/{res[n][1]:6.2f}" for n in names)
                print(
                    f"{name:20} {precision:5} {phase:5} {load:5.2f} "
                    f"{res['native'][2] * 1e3:9.1f} {cells}   [{shape}]",
                    flush=True,
                )
                for c in tune.choices(tuned_cfg).values():
                    print(f"{'':26} tuned -> {c.winner.removeprefix('forward_')}: {c.why()}")


if __name__ == "__main__":
    main()
