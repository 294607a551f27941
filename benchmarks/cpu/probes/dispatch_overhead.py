"""Per-call cost of ditops' dispatch on tiny inputs, where the kernel itself costs little.

For each op: the eager call through ditops (validation, plan lookup, per-call reasons,
the chosen path) against the same path's kernel called directly, on the same inputs, in
one run. The difference is the dispatch overhead per call. The least of ``--repeats``
runs of ``--calls`` calls each (noise only adds time).

    python benchmarks/cpu/probes/dispatch_overhead.py [--calls 200] [--repeats 300]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

import ditops


def per_call_us(fns: list[Callable[[], object]], calls: int, repeats: int) -> list[float]:
    """Per-call microseconds of each of ``fns``, the least of ``repeats`` runs of ``calls``
    calls, the functions taking turns run by run (so they see the same machine state)."""
    for fn in fns:
        for _ in range(200):
            fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best[i] = min(best[i], (time.perf_counter() - t0) / calls * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    res = torch.randn(1, 4, 64, dtype=torch.bfloat16)
    gate = torch.randn(1, 1, 64, dtype=torch.float32)
    norm = ditops.FP32LayerNorm(64, dtype=torch.bfloat16)
    w, b = norm.weight.float(), norm.bias.float()

    from ditops.kernels.cpu.layer_norm import fp32_layer_norm
    from ditops.kernels.cpu.modulation import gated_residual as gated_kernel

    rows: list[tuple[str, float, float]] = []
    with torch.inference_mode():
        op, direct = per_call_us(
            [
                lambda: norm(x),
                lambda: fp32_layer_norm(
                    x, [64], norm.weight.float(), norm.bias.float(), 1e-5, False
                ),
            ],
            args.calls,
            args.repeats,
        )
        rows.append(("fp32_layer_norm [4, 64] bf16", op, direct))
        op, direct = per_call_us(
            [
                lambda: ditops.gated_residual(res, res, gate),
                lambda: gated_kernel(res, res, gate, False),
            ],
            args.calls,
            args.repeats,
        )
        rows.append(("gated_residual [1, 4, 64] bf16", op, direct))
    del w, b
    print(f"torch {torch.__version__}, 1 thread, {args.calls} calls x {args.repeats} repeats (min)")
    print(f"{'op':<34} {'ditops us':>10} {'kernel us':>10} {'overhead us':>12}")
    for name, op, direct in rows:
        print(f"{name:<34} {op:>10.2f} {direct:>10.2f} {op - direct:>12.2f}")


if __name__ == "__main__":
    main()
