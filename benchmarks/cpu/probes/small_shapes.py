"""Small shapes: a ditops op call against the plain torch expression it replaces.

Per op and a few small shapes, the eager expression (the op's meaning written out as a
model writes it) and the public ditops call, timed in turns (round by round, so both see
the same machine state), under ``torch.inference_mode()``. Prints the median per-call
microseconds of each, the ratio ditops / eager (issue 39: at most 1.2) and the load.

    python benchmarks/cpu/probes/small_shapes.py [--precision fast|exact] [--rounds 41]
        [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import ditops

Case = tuple[str, Callable[[], object], Callable[[], object]]


def cases(dt: torch.dtype) -> list[Case]:
    g = torch.Generator().manual_seed(0)

    def r(*shape: int, dtype: torch.dtype = dt) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    out: list[Case] = []
    for shape in ((4, 64), (2, 16, 128), (1, 64, 256)):
        c = shape[-1]
        x, w, b = r(*shape), r(c, dtype=torch.float32), r(c, dtype=torch.float32)
        out.append(
            (
                f"fp32_layer_norm {list(shape)}",
                lambda x=x, w=w, b=b, c=c: F.layer_norm(x.float(), (c,), w, b, 1e-5).to(x.dtype),
                lambda x=x, w=w, b=b, c=c: ditops.fp32_layer_norm(x, (c,), w, b, 1e-5),
            )
        )
    for shape in ((1, 8, 64), (1, 24, 8, 128)):
        x, w = r(*shape), r(shape[-1])
        out.append(
            (
                f"rms_norm {list(shape)}",
                lambda x=x, w=w: F.rms_norm(x, (x.shape[-1],), w),
                lambda x=x, w=w: ditops.rms_norm(x, w),
            )
        )
    for shape in ((1, 16, 64), (1, 64, 256)):
        c = shape[-1]
        x, res = r(*shape), r(*shape)
        w, b = r(c, dtype=torch.float32), r(c, dtype=torch.float32)
        s, t, gate = (r(1, 1, c, dtype=torch.float32) for _ in range(3))
        out.append(
            (
                f"layer_norm_scale_shift {list(shape)}",
                lambda x=x, w=w, b=b, s=s, t=t, c=c: (
                    F.layer_norm(x.float(), (c,), w, b, 1e-5) * (1 + s) + t
                ).to(x.dtype),
                lambda x=x, w=w, b=b, s=s, t=t: ditops.layer_norm_scale_shift(x, w, b, s, t),
            )
        )
        out.append(
            (
                f"gated_residual {list(shape)}",
                lambda res=res, x=x, gate=gate: (res.float() + x * gate).to(res.dtype),
                lambda res=res, x=x, gate=gate: ditops.gated_residual(res, x, gate),
            )
        )
        sm, tm, gm = (r(1, 1, c) for _ in range(3))
        out.append(
            (
                f"adaln_modulate {list(shape)}",
                lambda x=x, sm=sm, tm=tm, c=c: (
                    F.layer_norm(x, (c,), None, None, 1e-6) * (1 + sm) + tm
                ),
                lambda x=x, sm=sm, tm=tm: ditops.adaln_modulate(x, sm, tm),
            )
        )
        out.append(
            (
                f"adaln_residual {list(shape)}",
                lambda res=res, x=x, gm=gm: res + gm * x,
                lambda res=res, x=x, gm=gm: ditops.adaln_residual(res, x, gm),
            )
        )
    for shape in ((16, 256), (64, 1024)):
        x, bias = r(*shape), r(shape[-1])
        out.append(
            (
                f"gelu_tanh_bias {list(shape)}",
                lambda x=x, bias=bias: F.gelu(x + bias, approximate="tanh"),
                lambda x=x, bias=bias: ditops.gelu_tanh_bias(x, bias),
            )
        )
    return out


def median_us(fns: list[Callable[[], object]], calls: int, rounds: int) -> list[float]:
    """Median per-call microseconds of each of ``fns`` over ``rounds`` rounds of ``calls``
    calls, the functions taking turns within each round."""
    for fn in fns:
        for _ in range(50):
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times[i].append((time.perf_counter() - t0) / calls * 1e6)
    return [statistics.median(t) for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", choices=("fast", "exact"), default="fast")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dt = getattr(torch, args.dtype)
    with open("/proc/loadavg") as f:
        load_before = f.read().split()[:3]
    rows = []
    with torch.inference_mode(), ditops.override(precision=args.precision):
        for name, eager, op in cases(dt):
            torch.testing.assert_close(op(), eager(), atol=0.05, rtol=0.05)  # same thing
            e, d = median_us([eager, op], args.calls, args.rounds)
            rows.append((name, e, d))
    with open("/proc/loadavg") as f:
        load_after = f.read().split()[:3]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, "
        f"precision {args.precision}, DITOPS_TUNE={ditops.config.get().tune}, "
        f"{args.calls} calls x {args.rounds} rounds (median), inference_mode"
    )
    print(f"load before {' '.join(load_before)}, after {' '.join(load_after)}")
    print(f"{'op [shape]':<40} {'eager us':>9} {'ditops us':>10} {'ratio':>6}")
    for name, e, d in rows:
        print(f"{name:<40} {e:>9.1f} {d:>10.1f} {d / e:>6.2f}")


if __name__ == "__main__":
    main()
