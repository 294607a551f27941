"""The exact CPU kernels before and after a change, in both states of glibc's malloc.

    python benchmarks/cpu/probes/malloc_states.py [--before COMMIT] [--rounds N] [--json PATH]

Runs itself in two child processes, one with glibc's mmap threshold free to grow (the
default; ``MALLOC_MMAP_THRESHOLD_`` removed from the environment) and one with it fixed at
its starting value (``MALLOC_MMAP_THRESHOLD_=131072``). In each it times, interleaved
round by round (median of the rounds): the eager meaning (``native``), ``torch.compile``
of it, a ``clone`` of the bytes it must move, and the exact kernel of ``COMMIT``
(``before``, loaded from git) and of the working tree (``after``), called directly. Both
kernels are checked bitwise against the meaning first.

Cases: FP32LayerNorm bf16 [8192, 5120] with fp32 weight and bias; Wan's modulated norm
``(LN(h.float()) * (1 + scale) + shift).type_as(h)`` and the fused residual + norm on
bf16 [1, 8192, 5120] with fp32 [1, 1, C] modulation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
STATES = {"grows": None, "fixed": "131072"}
EPS = 1e-6

_NO_OP_OPAQUE = """
def opaque_op(name):
    def decorate(fn):
        fn.register_fake = lambda fake: fake
        return fn
    return decorate
"""


def _load_before(commit: str, name: str) -> types.ModuleType:
    """``ditops.kernels.cpu.<name>`` as of ``commit``, without registering its custom ops."""
    src = subprocess.run(
        ["git", "show", f"{commit}:src/ditops/kernels/cpu/{name}.py"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    src = src.replace("from ditops.kernels.opaque import opaque_op\n", _NO_OP_OPAQUE)
    module = types.ModuleType(f"before_{name}")
    exec(compile(src, f"{commit}:{name}.py", "exec"), module.__dict__)
    return module


def _cases(before: dict[str, Any]) -> dict[str, dict[str, Callable[[], Any]]]:
    import torch
    import torch.nn.functional as F

    from ditops.kernels.cpu import layer_norm as ln_after
    from ditops.kernels.cpu import modulation as mod_after

    gen = torch.Generator().manual_seed(0)
    R, C = 8192, 5120
    x = torch.randn(R, C, generator=gen).bfloat16()
    w, b = torch.randn(C, generator=gen), torch.randn(C, generator=gen)
    h = torch.randn(1, R, C, generator=gen).bfloat16()
    attn = torch.randn(1, R, C, generator=gen).bfloat16()
    scale, shift, gate = (torch.randn(1, 1, C, generator=gen) * 0.1 for _ in range(3))

    def ln(x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), (C,), w, b, EPS).to(x.dtype)

    def ln_mod(h: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(h.float(), (C,), None, None, EPS)
        return (y * (1 + scale) + shift).type_as(h)

    def fused(h: torch.Tensor, attn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = (h.float() + attn * gate).type_as(h)
        return ln_mod(h), h

    comp = {f.__name__: torch.compile(f, dynamic=False) for f in (ln, ln_mod, fused)}
    roof = torch.ones(4 * h.numel(), dtype=torch.uint8)  # 2 bf16 in, 2 bf16 out (fused)

    def runs(ln_mod_: Any, mod_mod: Any) -> dict[str, Callable[[], Any]]:
        """The three exact kernels of one version of the two modules."""
        return {
            "ln": lambda: ln_mod_.fp32_layer_norm(x, [C], w, b, EPS, True),
            "ln_mod": lambda: mod_mod.layer_norm_scale_shift(
                h, None, None, scale, shift, EPS, h.dtype, True
            ),
            "fused": lambda: mod_mod.scale_residual_layer_norm_scale_shift(
                h, attn, gate, None, None, scale, shift, EPS, h.dtype, True
            ),
        }

    old = runs(before["layer_norm"], before["modulation"])
    new = runs(ln_after, mod_after)
    meaning = {"ln": lambda: ln(x), "ln_mod": lambda: ln_mod(h), "fused": lambda: fused(h, attn)}
    compiled = {
        "ln": lambda: comp["ln"](x),
        "ln_mod": lambda: comp["ln_mod"](h),
        "fused": lambda: comp["fused"](h, attn),
    }
    clones = {"ln": x.clone, "ln_mod": h.clone, "fused": roof.clone}
    names = {
        "ln": "fp32_layer_norm exact 8192x5120 bf16",
        "ln_mod": "ln_mod exact 1x8192x5120 bf16 [B,1,C]",
        "fused": "fused exact 1x8192x5120 bf16 [B,1,C]",
    }
    out: dict[str, dict[str, Callable[[], Any]]] = {}
    for kind, name in names.items():
        ref = meaning[kind]()
        refs = ref if isinstance(ref, tuple) else (ref,)
        for version in (old, new):
            got = version[kind]()
            for a, r in zip(got if isinstance(got, tuple) else (got,), refs, strict=True):
                assert torch.equal(a.view(torch.int16), r.view(torch.int16)), name
        out[name] = {
            "native": meaning[kind],
            "compile": compiled[kind],
            "clone": clones[kind],
            "before": old[kind],
            "after": new[kind],
        }
    return out


def _child(commit: str, rounds: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(2)
    before = {n: _load_before(commit, n) for n in ("layer_norm", "modulation")}
    cases = _cases(before)
    times: dict[str, dict[str, list[float]]] = {c: {v: [] for v in vs} for c, vs in cases.items()}
    with torch.inference_mode():
        for variants in cases.values():
            for fn in variants.values():
                fn()  # compiles, warms the scratch and the allocator
        for _ in range(rounds):
            for case, variants in cases.items():
                for v, fn in variants.items():
                    t0 = time.perf_counter()
                    fn()
                    times[case][v].append(time.perf_counter() - t0)
    return {
        case: {v: statistics.median(ts) * 1e3 for v, ts in vs.items()} for case, vs in times.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", default="4a299e3", help="the commit to compare against")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", default=None, metavar="PATH")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.before, args.rounds)))
        return
    results: dict[str, Any] = {}
    for state, value in STATES.items():
        env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
        if value is not None:
            env["MALLOC_MMAP_THRESHOLD_"] = value
        env["PYTHONPATH"] = str(ROOT / "src")
        cmd = [
            sys.executable,
            __file__,
            "--child",
            "--before",
            args.before,
            "--rounds",
            str(args.rounds),
        ]
        out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
        results[state] = json.loads(out.strip().splitlines()[-1])
    print(f"median of {args.rounds} interleaved rounds, 2 threads; before = {args.before}")
    print(
        f"{'case':<40} {'malloc':<7} {'native':>8} {'compile':>8} {'clone':>7} {'before':>8} "
        f"{'after':>8} {'before x nat':>12} {'after x nat':>11}"
    )
    for case in results["grows"]:
        for state in STATES:
            t = results[state][case]
            print(
                f"{case:<40} {state:<7} {t['native']:8.1f} {t['compile']:8.1f} {t['clone']:7.1f} "
                f"{t['before']:8.1f} {t['after']:8.1f} {t['native'] / t['before']:12.2f} "
                f"{t['native'] / t['after']:11.2f}"
            )
    if args.json:
        payload = {"command": " ".join(sys.argv), "before": args.before, "ms": results}
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
