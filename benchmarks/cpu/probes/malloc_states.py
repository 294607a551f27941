"""The exact CPU kernels before and after a change, in both states of glibc's malloc.

    python benchmarks/cpu/probes/malloc_states.py [--before COMMIT] [--rounds N] [--threads T]
        [--json PATH]

Runs itself in two child processes, one with glibc's mmap threshold free to grow (the
default; ``MALLOC_MMAP_THRESHOLD_`` removed from the environment) and one with it fixed at
its starting value (``MALLOC_MMAP_THRESHOLD_=131072``). In each it times, interleaved
round by round (median of the rounds): the eager meaning (``native``), ``torch.compile``
of it, a ``clone`` of the bytes it must move, and the exact kernel of ``COMMIT``
(``before``, loaded from git) and of the working tree (``after``), called directly. Both
kernels are checked bitwise against the meaning first.

Per call it records the wall time, the CPU time of the process (user + system, all
threads: on a shared machine the wall time mostly measures waiting for a core) and the
minor page faults.

Cases: FP32LayerNorm bf16 [8192, 5120] with fp32 weight and bias; Wan's modulated norm
``(LN(h.float()) * (1 + scale) + shift).type_as(h)`` and the fused residual + norm on
bf16 [1, 8192, 5120] with fp32 [1, 1, C] modulation.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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


def _usage() -> tuple[float, float, int]:
    """(wall s, CPU s of every thread: user + system, minor page faults) so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), r.ru_utime + r.ru_stime, r.ru_minflt


def _child(commit: str, rounds: int, threads: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    before = {n: _load_before(commit, n) for n in ("layer_norm", "modulation")}
    cases = _cases(before)
    samples: dict[str, dict[str, list[tuple[float, float, int]]]] = {
        c: {v: [] for v in vs} for c, vs in cases.items()
    }
    with torch.inference_mode():
        for variants in cases.values():
            for fn in variants.values():
                fn()  # compiles, warms the scratch and the allocator
        for _ in range(rounds):
            for case, variants in cases.items():
                for v, fn in variants.items():
                    w0, c0, f0 = _usage()
                    fn()
                    w1, c1, f1 = _usage()
                    samples[case][v].append((w1 - w0, c1 - c0, f1 - f0))
    return {
        case: {
            v: {
                "wall_ms": statistics.median(s[0] for s in ss) * 1e3,
                "cpu_ms": statistics.median(s[1] for s in ss) * 1e3,
                "faults": int(statistics.median(s[2] for s in ss)),
            }
            for v, ss in vs.items()
        }
        for case, vs in samples.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", default="4a299e3", help="the commit to compare against")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--json", default=None, metavar="PATH")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.before, args.rounds, args.threads)))
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
            "--threads",
            str(args.threads),
        ]
        out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
        results[state] = json.loads(out.strip().splitlines()[-1])
    print(
        f"median of {args.rounds} interleaved rounds, {args.threads} thread(s); "
        f"before = {args.before}; load average {os.getloadavg()[0]:.1f}\n"
        "wall ms / CPU ms (user + system, all threads) / minor page faults per call"
    )
    variants = ("native", "compile", "clone", "before", "after")
    head = " ".join(f"{v:>20}" for v in variants)
    print(f"{'case':<38} {'malloc':<6} {head} {'x native: before':>17} {'after':>6}")
    for case in results["grows"]:
        for state in STATES:
            t = results[state][case]
            cells = " ".join(
                f"{t[v]['wall_ms']:7.0f}/{t[v]['cpu_ms']:5.0f}/{t[v]['faults']:6d}"
                for v in variants
            )
            nat = t["native"]
            ratio = {v: nat["wall_ms"] / t[v]["wall_ms"] for v in ("before", "after")}
            cpu = {v: nat["cpu_ms"] / t[v]["cpu_ms"] for v in ("before", "after")}
            print(
                f"{case:<38} {state:<6} {cells} "
                f"{ratio['before']:5.2f} ({cpu['before']:4.2f} cpu) {ratio['after']:5.2f} "
                f"({cpu['after']:4.2f} cpu)"
            )
    if args.json:
        payload = {
            "command": " ".join(sys.argv),
            "before": args.before,
            "threads": args.threads,
            "load_average": os.getloadavg(),
            "ms": results,
        }
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
