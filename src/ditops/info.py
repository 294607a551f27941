"""``ditops info``: what this machine has and which path each op takes on it, short.

A header (ditops and the libraries it works with, their versions; the CPU and the
features the CPU paths care about; the accelerators), the op x device-kind table with
the reasons a fast path cannot run, and one line about the tuned choices (``--tuned``:
each shape class, its winner and the times that chose it). ``--json``: the same as data,
with :data:`SCHEMA_VERSION`; the tuned choices' detail only with ``--tuned``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
from typing import Any

import torch

from ditops import config
from ditops._version import __version__
from ditops.core import tune, tune_report
from ditops.core.explain import explain, table
from ditops.platform import DEVICE_KINDS, cpu_flags, platform_summary

#: Bumped when a key of ``ditops info --json`` changes meaning or goes away.
SCHEMA_VERSION = 2
#: The libraries named in the header (distribution names).
LIBRARIES = ("torch", "diffusers", "transformers", "triton", "sglang", "torch_npu")
#: CPU features the CPU paths depend on: /proc/cpuinfo flag -> the name people know.
CPU_FEATURES = {
    "avx2": "AVX2",
    "avx512f": "AVX-512",
    "avx512_bf16": "AVX-512-BF16",
    "amx_tile": "AMX",
}
SHAPE_CLASS = (
    "a shape class: op, device kind, precision, and each tensor's dtype and dims rounded "
    "to the nearest power of two"
)


def versions() -> dict[str, str | None]:
    """ditops' and each of :data:`LIBRARIES`' installed version (None: not installed)."""
    found: dict[str, str | None] = {"ditops": __version__}
    for name in LIBRARIES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    found["torch"] = torch.__version__  # the one imported (a build tag such as +cpu)
    return found


def cpu() -> dict[str, Any]:
    """The CPU's model name and which of :data:`CPU_FEATURES` it has."""
    fp = tune.fingerprint()
    flags = cpu_flags()
    features = {name: flag in flags for flag, name in CPU_FEATURES.items()}
    return {
        "model": fp.get("cpu", ""),
        "threads": torch.get_num_threads(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "features": features if flags else None,
    }


def accelerators(plat: dict[str, Any]) -> list[str]:
    """One phrase per accelerator kind visible here, with its runtime where it has one."""
    found = []
    for kind, count in plat["visible_devices"].items():
        if kind == "cpu" or not count:
            continue
        runtime = {"cuda": plat.get("cuda_runtime"), "hip": plat.get("hip_runtime")}.get(kind)
        names = plat.get("cuda_devices") if kind in ("cuda", "hip") else None
        what = f"{count} x {names[0]}" if names else str(count)
        found.append(f"{kind}: {what}" + (f" ({kind.upper()} {runtime})" if runtime else ""))
    return found


def header(payload: dict[str, Any]) -> list[str]:
    """The first lines: versions, CPU, accelerators, settings."""
    ver = payload["versions"]
    lines = [", ".join(f"{k} {v}" for k, v in ver.items() if v is not None)]
    absent = [k for k, v in ver.items() if v is None]
    if absent:
        lines[0] += f"  (not installed: {', '.join(absent)})"
    c = payload["cpu"]
    feats = c["features"]
    have = (
        "unknown"
        if feats is None
        else ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in feats.items())
    )
    lines.append(
        f"CPU: {c['model']}, {c['threads']} threads, torch capability {c['capability']}; {have}"
    )
    accel = payload["accelerators"]
    lines.append(f"accelerators: {', '.join(accel) if accel else 'none'}")
    lines.append("config: " + ", ".join(f"{k}={v}" for k, v in payload["config"].items()))
    return lines


def tuned_summary(data: dict[str, Any]) -> list[str]:
    """One line (two with the hint) for the tuned choices, however many there are."""
    if data["mode"] == "off":
        return ["tuned choices: none (DITOPS_TUNE=off: the first usable path in declared order)"]
    found = data["choices"]
    ops = sorted({key.split("/", 1)[0] for key in found})
    moved = sum(1 for c in found.values() if c["winner"] != "forward_native")
    return [
        f"tuned choices (DITOPS_TUNE={data['mode']}): {len(found)} shape classes of "
        f"{len(ops)} ops, {moved} on a fast path; cache {data['cache_file']}",
        f"  --tuned: each class, its winner and the times that chose it ({SHAPE_CLASS})",
    ]


def readable_class(key: str) -> str:
    """``op/kind/precision/dtype[e0,e1]...`` with its dims as powers of two (``2^13``
    reads 8192): the key stores exponents."""

    def dims(m: re.Match[str]) -> str:
        return (
            "["
            + ",".join(str(2 ** int(e)) if e != "-1" else "0" for e in m.group(1).split(",") if e)
            + "]"
        )

    op, kind, precision, shapes = key.split("/", 3)
    return f"{op} {kind} {precision} " + re.sub(r"\[([-\d,]*)\]", dims, shapes)


def run(args: argparse.Namespace) -> int:
    """``ditops info``: print the report (or its JSON)."""
    decisions = explain(precision=args.precision)
    cfg = config.get()
    plat = platform_summary()
    payload: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "versions": versions(),
        "cpu": cpu(),
        "accelerators": accelerators(plat),
        "platform": plat,
        "config": {
            "DITOPS_CUSTOM_OPS": cfg.custom_ops.text,
            "DITOPS_STRICT": cfg.strict,
            "DITOPS_PRECISION": cfg.precision,
            "DITOPS_TUNE": cfg.tune,
        },
        "precision": args.precision or cfg.precision,
        "ops": [d.as_dict() for d in decisions],
    }
    from ditops.integrations.release_table import diffusers_report

    payload["diffusers"] = diffusers_report()  # the installed release against the tested ones
    tuning, _ = tune_report.report(cfg)
    summary = tuned_summary(tuning)
    payload["tuning"] = {k: v for k, v in tuning.items() if k != "choices"}
    payload["tuning"]["summary"] = summary[0]
    if args.tuned:
        payload["tuning"]["choices"] = tuning["choices"]
    if args.json:
        print(json.dumps(payload, indent=2, default=str))
        return 0
    for line in header(payload):
        print(line)
    print(payload["diffusers"]["line"])
    print(f"precision explained: {payload['precision']}\n")
    for line in table(decisions, DEVICE_KINDS):
        print(line)
    print(
        "\nA cell names the path each op takes for tensors of that device kind (one Triton path"
        "\nserves cuda, hip and xpu); native: the meaning, no fast path exists; native*: a fast"
        "\npath exists but cannot run here, for the reasons below; a/b: a for the calls it"
        "\ntakes (dtype, shape: --verbose says which), b for the others."
    )
    _reasons(decisions, plat)
    if args.verbose:
        print("\nwhat each fast path takes (per-call conditions):")
        done: set[tuple[str, str]] = set()
        for d in decisions:
            for c in d.candidates:
                if c.accepts and (d.op, c.path) not in done:
                    done.add((d.op, c.path))
                    print(f"  {d.op}.{c.path}: {c.accepts}")
    else:
        print("\n--verbose: also what each fast path takes (dtypes, precision, backend).")
    print("\n" + "\n".join(summary))
    if args.tuned:
        print(f"\n{SHAPE_CLASS}:")
        for key, c in tuning["choices"].items():
            winner = c["winner"].removeprefix("forward_")
            print(f"  {readable_class(key)}\n      -> {winner}: {c['why']}")
    return 0


def _reasons(decisions: list[Any], plat: dict[str, Any]) -> None:
    """One line per (device kind, reasons): ops sharing a backend share its reasons."""
    why: dict[tuple[str, str], list[str]] = {}
    for d in decisions:
        for c in d.candidates:
            if c.reasons and c.accepts:
                why.setdefault((d.device_kind, "; ".join(c.reasons)), []).append(f"{d.op}.{c.path}")
    if why:
        print("\nnot used:")
    for (kind, reasons), paths in why.items():
        absent = "" if plat["visible_devices"].get(kind) else ", no such device here"
        print(f"  {kind}{absent}: {', '.join(paths)}:\n      {reasons}")
