"""CPU paths against their meaning, quiet and with a busy neighbour, at Wan and FLUX sizes.

Per case, one run interleaves (round by round, each variant once per round): the meaning
(``native``), the CPU path called directly with the process's intra-op threads
(``path``, ``blocks.THREADS = None``) and with one (``path 1t``, ``blocks.THREADS = 1``);
each case first quiet, then with a spinning process started for that phase (``busy``).
Medians of per-round ratios to the meaning of the same round (>1: faster than the
meaning). The load average is printed at each phase. Precision exact unless the case says fast.

    PYTHONPATH=src python benchmarks/cpu/probes/busy_neighbour.py [--rounds 7] [--only wan]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterator

import torch

from ditops import config
from ditops.bench.harness import cpu_features
from ditops.bench.load import blocked_kernel_threads as kernel_threads
from ditops.bench.load import busy_neighbour, header, ratios_to

Fn = Callable[[], object]


def cases(only: str | None) -> Iterator[tuple[str, str, Fn, Fn]]:
    from ditops.ops import modulation_fp32 as m32
    from ditops.ops import modulation_model_dtype as mmd
    from ditops.ops.layer_norm import fp32_layer_norm

    g = torch.Generator().manual_seed(0)

    def r(*s: int, dt: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*s, generator=g).to(dt)

    if only in (None, "wan"):
        L, C = 8064, 1536  # the bench Wan: 21 x 16 x 24 tokens, dim 1536
        h, a = r(1, L, C), r(1, L, C)
        sc, sh, gt = (r(1, 1, C, dt=torch.float32) * 0.1 for _ in range(3))
        w, b = r(C, dt=torch.float32), r(C, dt=torch.float32)
        op = m32.layer_norm_scale_shift
        call = op.prepare(h, None, None, sc, sh, 1e-6)
        yield (
            "wan ln_mod [1,8064,1536]",
            "exact",
            lambda: op.forward_native(call),
            lambda: op.forward_cpu(call),
        )
        op2 = m32.scale_residual_layer_norm_scale_shift
        call2 = op2.prepare(h, a, gt, w, b, None, None, 1e-6)
        yield (
            "wan fused norm2 [1,8064,1536]",
            "exact",
            lambda: op2.forward_native(call2),
            lambda: op2.forward_cpu(call2),
        )
        op3 = m32.gated_residual
        call3 = op3.prepare(h, a.float(), gt)
        yield (
            "wan gated (ffn) [1,8064,1536]",
            "exact",
            lambda: op3.forward_native(call3),
            lambda: op3.forward_cpu(call3),
        )
        x = r(L, C)
        call4 = fp32_layer_norm.prepare(x, (C,), w, b, 1e-6)
        yield (
            "FP32LayerNorm [8064,1536]",
            "exact",
            lambda: fp32_layer_norm.forward_native(call4),
            lambda: fp32_layer_norm.forward_cpu(call4),
        )
        yield (
            "FP32LayerNorm [8064,1536]",
            "fast",
            lambda: fp32_layer_norm.forward_native(call4),
            lambda: fp32_layer_norm.forward_cpu(call4),
        )
    if only in (None, "flux"):
        L, C = 4096 + 512, 3072  # FLUX 1024px: 4096 image + 512 text tokens, dim 3072
        h, a = r(1, L, C), r(1, L, C)
        sc, sh, gt = (r(1, 1, C) * 0.1 for _ in range(3))
        op = mmd.adaln_modulate
        call = op.prepare(h, sc, sh, 1e-6)
        yield (
            "flux adaln_modulate [1,4608,3072]",
            "exact",
            lambda: op.forward_native(call),
            lambda: op.forward_cpu(call),
        )
        op2 = mmd.adaln_residual
        call2 = op2.prepare(h, a, gt)
        yield (
            "flux adaln_residual [1,4608,3072]",
            "exact",
            lambda: op2.forward_native(call2),
            lambda: op2.forward_cpu(call2),
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--only", choices=("wan", "flux"), default=None)
    args = parser.parse_args()
    print("\n".join(header()))
    print(f"cpu: {cpu_features()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}")
    print(f"command: {' '.join(sys.argv)}")
    print("ratios to the meaning: median of per-round ratios / ratio of best times")
    print(
        f"{'case':34} {'prec':5} {'phase':5} {'load':>5} {'native ms':>9} "
        f"{'path':>11} {'path 1t':>11}"
    )
    with torch.inference_mode():
        for name, precision, native, fast in cases(args.only):
            for busy in (False, True):
                with busy_neighbour(busy), config.override(precision=precision):
                    load = os.getloadavg()[0]
                    t0 = time.perf_counter()
                    native()
                    ms = (time.perf_counter() - t0) * 1e3

                    def one_thread(fast: Callable[[], object] = fast) -> object:
                        with kernel_threads(1):
                            return fast()

                    def all_threads(fast: Callable[[], object] = fast) -> object:
                        with kernel_threads(None):
                            return fast()

                    variants = {"native": native, "path": all_threads, "path 1t": one_thread}
                    res = ratios_to("native", variants, args.rounds, warmup=2)
                phase = "busy" if busy else "quiet"
                print(
                    f"{name:34} {precision:5} {phase:5} {load:5.2f} {ms:9.1f} "
                    f"{res['path'][0]:5.2f}/{res['path'][1]:5.2f} "
                    f"{res['path 1t'][0]:5.2f}/{res['path 1t'][1]:5.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
