"""Per-call cost of ditops' dispatch on tiny inputs, where the kernel itself costs little.

For each op: the eager call through ditops (validation, plan lookup, per-call reasons,
the chosen path) against the same path's kernel called directly, on the same inputs, in
one run. The difference is the dispatch overhead per call. Median of 7 repeats of
``--calls`` calls each.

    python benchmarks/cpu/probes/dispatch_overhead.py [--calls 5000]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import ditops


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(200):
        fn()
    runs = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5000)
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
        op = per_call_us(lambda: norm(x), args.calls)
        direct = per_call_us(
            lambda: fp32_layer_norm(x, [64], norm.weight.float(), norm.bias.float(), 1e-5, False),
            args.calls,
        )
        rows.append(("fp32_layer_norm [4, 64] bf16", op, direct))
        op = per_call_us(lambda: ditops.gated_residual(res, res, gate), args.calls)
        direct = per_call_us(lambda: gated_kernel(res, res, gate, False), args.calls)
        rows.append(("gated_residual [1, 4, 64] bf16", op, direct))
    del w, b
    print(f"torch {torch.__version__}, 1 thread, {args.calls} calls x 7 repeats (median)")
    print(f"{'op':<34} {'ditops us':>10} {'kernel us':>10} {'overhead us':>12}")
    for name, op, direct in rows:
        print(f"{name:<34} {op:>10.2f} {direct:>10.2f} {op - direct:>12.2f}")


if __name__ == "__main__":
    main()
