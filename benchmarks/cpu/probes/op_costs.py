"""Where the time goes: each norm op of a patched block at a model's shapes, ditops' path
against the meaning (eager), ``torch.compile`` of the meaning and a copy of the bytes.

``--model wan``: the ``ditops bench wan`` model's shapes (bf16 ``[1, 8064, 1536]``, fp32
``[1, 1, C]`` modulation, 12 heads of 128, eps 1e-6): the ops the exact patch runs per
block (``layer_norm_scale_shift``, ``scale_residual_layer_norm_scale_shift`` with and
without affine, ``gated_residual`` with a bf16 feed-forward output, ``qk_norm_rope``
across heads) and ``fp32_layer_norm`` (``norm_out``). ``--model flux``: FLUX.1-dev's
(dim 3072, 24 heads of 128, 4096 image + 512 text tokens, bf16 modulation, eps 1e-6):
``adaln_modulate``, ``adaln_residual``, ``adaln_residual_modulate``, ``qk_norm_rope`` per
head and ``rms_norm`` (one head's q norm as a [L, 24, 128] call).

Variants, interleaved per round (rotating order): ``meaning`` (``op.forward_native``),
``compile`` (``torch.compile`` of it), ditops with ``DITOPS_TUNE=off`` (the device path)
and ``on`` (the tuner's pick), each in ``--precision``, and ``copy`` (a clone of half the
bytes the op must move: one read of each input, one write of each output). Per op: the
expected copy time from the bytes and the copy bandwidth measured first, then each
variant's median ms and median per-round ratio to the meaning; ``of copy`` = copy time /
variant time (1.0 = at the memory roofline). Load average printed per op.

    PYTHONPATH=src python benchmarks/cpu/probes/op_costs.py --model wan [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import ditops
from ditops import config
from ditops.bench.harness import cpu_features
from ditops.bench.load import header

EPS = 1e-6
D = 128


def _rand(gen: torch.Generator, *shape: int, dtype=torch.bfloat16, scale=1.0, shift=0.0):
    return (torch.randn(*shape, generator=gen) * scale + shift).to(dtype)


def wan_ops(gen: torch.Generator) -> dict[str, tuple[Any, tuple, dict, int]]:
    """name -> (public op, args, kwargs, bytes moved)."""
    L, C, H = 8064, 1536, 12
    h, a, ff = (_rand(gen, 1, L, C) for _ in range(3))
    s, t, g = (_rand(gen, 1, 1, C, dtype=torch.float32, scale=0.1) for _ in range(3))
    w, b = _rand(gen, C, dtype=torch.float32, shift=1.0), _rand(gen, C, dtype=torch.float32)
    q, k = _rand(gen, 1, L, H, D), _rand(gen, 1, L, H, D)
    wq, wk = (_rand(gen, H * D, scale=0.3, shift=1.0) for _ in range(2))
    ang = torch.rand(L, D // 2, generator=gen) * 6.28
    act = h.numel() * 2
    return {
        "layer_norm_scale_shift": (ditops.layer_norm_scale_shift, (h, None, None, s, t, EPS), {}, 2 * act),
        "fused (norm2: affine)": (ditops.scale_residual_layer_norm_scale_shift, (h, a, g, w, b, None, None, EPS), {}, 4 * act),
        "fused (norm3: scale/shift)": (ditops.scale_residual_layer_norm_scale_shift, (h, a, 1, None, None, s, t, EPS), {}, 4 * act),
        "gated_residual (ffn)": (ditops.gated_residual, (h, ff, g), {}, 3 * act),
        "qk_norm_rope": (ditops.qk_norm_rope, (q, k, wq, wk, ang.cos(), ang.sin(), EPS), {"across_heads": True}, 4 * act),
        "fp32_layer_norm (norm_out)": (ditops.fp32_layer_norm, (h, (C,), None, None, EPS), {}, 2 * act),
    }  # fmt: skip


def flux_ops(gen: torch.Generator) -> dict[str, tuple[Any, tuple, dict, int]]:
    L, C, H = 4608, 3072, 24
    h, a = _rand(gen, 1, L, C), _rand(gen, 1, L, C)
    s, t, g = (_rand(gen, 1, 1, C, scale=0.1) for _ in range(3))
    q, k = _rand(gen, 1, L, H, D), _rand(gen, 1, L, H, D)
    wq, wk = (_rand(gen, D, scale=0.3, shift=1.0) for _ in range(2))
    ang = torch.rand(L, D // 2, generator=gen) * 6.28
    act = h.numel() * 2
    return {
        "adaln_modulate": (ditops.adaln_modulate, (h, s, t, EPS), {}, 2 * act),
        "adaln_residual": (ditops.adaln_residual, (h, a, g), {}, 3 * act),
        "adaln_residual_modulate": (ditops.adaln_residual_modulate, (h, a, g, s, t, EPS), {}, 4 * act),
        "qk_norm_rope": (ditops.qk_norm_rope, (q, k, wq, wk, ang.cos(), ang.sin(), EPS), {}, 4 * act),
        "rms_norm": (ditops.rms_norm, (q, wq, EPS), {}, 2 * act),
    }  # fmt: skip


def _variants(fn: Any, args: tuple, kw: dict, precision: str, roof: torch.Tensor):
    native = fn.op.forward_native
    compiled = torch.compile(lambda *a: native(*a, **kw), dynamic=False)

    def under(tune: str | None, f: Callable[..., Any]) -> Callable[[], Any]:
        def run() -> Any:
            with torch.inference_mode(), config.override(precision=precision, tune=tune):
                return f(*args, **kw) if f is not compiled else f(*args)

        return run

    return {
        "meaning": under(None, native),
        "compile": under(None, compiled),
        "tune off": under("off", fn),
        "tune on": under("on", fn),
        "copy": roof.clone,
    }


def _interleaved(fns: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    for f in fns.values():
        f()
        f()
    secs: dict[str, list[float]] = {n: [] for n in fns}
    names = list(fns)
    for r in range(rounds):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            fns[n]()
            secs[n].append(time.perf_counter() - t0)
    return secs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("wan", "flux"), default="wan")
    p.add_argument("--precision", choices=("exact", "fast"), default="exact")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--only", default="", help="comma-separated op names (substring match)")
    a = p.parse_args()
    print("\n".join(header()))
    print(f"cpu: {cpu_features()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}")
    print(f"command: {' '.join(sys.argv)}")
    gen = torch.Generator().manual_seed(0)
    ops = (wan_ops if a.model == "wan" else flux_ops)(gen)
    big = torch.ones(256 << 20, dtype=torch.uint8)
    bw = 2 * big.numel() / min(_interleaved({"c": big.clone}, 5)["c"])
    del big
    print(f"copy bandwidth (read + write, 256 MiB clone, best of 5): {bw / 1e9:.1f} GB/s")
    cols = ("meaning", "compile", "tune off", "tune on", "copy")
    print(f"{'op':28} {'load':>4} {'MB':>5} {'exp ms':>6} | " + " | ".join(f"{c:>17}" for c in cols))
    print(f"{'':28} {'':>4} {'':>5} {'':>6} | " + " | ".join(f"{'ms  x mean  of cp':>17}" for c in cols))
    for name, (fn, args, kw, moved) in ops.items():
        if a.only and not any(s in name for s in a.only.split(",")):
            continue
        roof = torch.ones(moved // 2, dtype=torch.uint8)
        fns = _variants(fn, args, kw, a.precision, roof)
        load = os.getloadavg()[0]
        secs = _interleaved(fns, a.rounds)
        mean = secs["meaning"]
        cells = []
        for c in cols:
            ratio = statistics.median(m / s for m, s in zip(mean, secs[c], strict=True))
            of_copy = statistics.median(cp / s for cp, s in zip(secs["copy"], secs[c], strict=True))
            cells.append(f"{statistics.median(secs[c]) * 1e3:6.1f} {ratio:5.2f} {of_copy:4.2f}")
        exp = moved / bw * 1e3
        print(f"{name:28} {load:4.1f} {moved / 1e6:5.0f} {exp:6.1f} | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
