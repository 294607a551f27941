"""``rms_norm_scale`` against the expressions it replaces, at a block's shape (bf16).

Per family form, timed in turns (round by round, so all see the same machine state),
under ``torch.inference_mode()``: the family's eager expression (diffusers' code written
out), the previous patched form (``ditops.rms_norm`` then the eager product and casts),
the fused op (``ditops.rms_norm_scale``), optionally ``torch.compile`` of the eager
expression, and a copy of x's bytes (``x.clone()``, the memory floor). Prints median ms
and each one's speed-up over eager, plus the load.

    python benchmarks/cpu/probes/rms_norm_scale.py [--tokens 4096] [--rounds 15]
        [--precision exact|fast] [--compile]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

import ditops

EPS = 1e-6


def rms(x: torch.Tensor) -> torch.Tensor:
    """diffusers' RMSNorm without weight (its code)."""
    v = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    return (x * torch.rsqrt(v + EPS)).to(x.dtype)


def rms_w(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """diffusers' RMSNorm with a bf16 weight (its code)."""
    v = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    return (x * torch.rsqrt(v + EPS)).to(w.dtype) * w


def forms(tokens: int, compile_: bool) -> list[tuple[str, dict[str, Callable[[], object]]]]:
    g = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    out = []
    # Mochi: hidden 3072; (rms(x.float()) * (1 + scale.float())).to(bf16)
    x = torch.randn(1, tokens, 3072, generator=g).to(bf)
    s = 1 + torch.randn(1, 1, 3072, generator=g).to(bf).float()

    def mochi() -> object:
        return (rms(x.to(torch.float32)) * s).to(x.dtype)

    fns: dict[str, Callable[[], object]] = {
        "eager": mochi,
        "rms_norm + eager": lambda: (
            ditops.rms_norm(x.float(), None, EPS, "diffusers") * s
        ).to(x.dtype),
        "rms_norm_scale": lambda: ditops.rms_norm_scale(x, s, EPS, upcast=True),
        "copy": x.clone,
    }
    if compile_:
        fns["compile"] = torch.compile(mochi, dynamic=False)
    out.append((f"Mochi [1, {tokens}, 3072] upcast", fns))
    # Z-Image: dim 3840; rms_w(x) * scale, bf16 weight and scale
    x2 = torch.randn(1, tokens, 3840, generator=g).to(bf)
    w = (torch.randn(3840, generator=g) * 0.3 + 1).to(bf)
    s2 = (1 + torch.randn(1, 1, 3840, generator=g)).to(bf)

    def z_image() -> object:
        return rms_w(x2, w) * s2

    fns2: dict[str, Callable[[], object]] = {
        "eager": z_image,
        "rms_norm + eager": lambda: ditops.rms_norm(x2, w, EPS, "diffusers") * s2,
        "rms_norm_scale": lambda: ditops.rms_norm_scale(x2, s2, EPS, weight=w),
        "copy": x2.clone,
    }
    if compile_:
        fns2["compile"] = torch.compile(z_image, dynamic=False)
    out.append((f"Z-Image [1, {tokens}, 3840] weight", fns2))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--precision", default="exact", choices=["exact", "fast"])
    p.add_argument("--compile", action="store_true")
    a = p.parse_args()
    print(f"load before: {open('/proc/loadavg').read().strip()}  threads {torch.get_num_threads()}"
          f"  cpus {os.cpu_count()}  precision {a.precision}")  # fmt: skip
    with torch.inference_mode(), ditops.override(precision=a.precision):
        for name, fns in forms(a.tokens, a.compile):
            times: dict[str, list[float]] = {k: [] for k in fns}
            for fn in fns.values():  # warm up (compile, scratch, tuning)
                fn()
                fn()
            for _ in range(a.rounds):
                for k, fn in fns.items():
                    t0 = time.perf_counter()
                    fn()
                    times[k].append(time.perf_counter() - t0)
            eager = statistics.median(times["eager"])
            cols = "  ".join(
                f"{k} {1e3 * statistics.median(v):.2f} ms ({eager / statistics.median(v):.2f}x)"
                for k, v in times.items()
            )
            print(f"{name}: {cols}")
    print(f"load after: {open('/proc/loadavg').read().strip()}")


if __name__ == "__main__":
    main()
