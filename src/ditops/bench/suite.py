"""What a benchmark suite of ``ditops bench`` is: :class:`Suite`.

A suite module defines one as ``SUITE``; :mod:`ditops.bench.suites` lists the suite
modules by name and imports one when it is asked for.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ditops.bench import harness
from ditops.bench.harness import Case


@dataclass(frozen=True)
class Suite:
    """A function ``(device, size) -> Iterator[Case]`` plus how many timed steps it makes
    (for the progress bar). ``size`` is ``"small"`` (the default, short enough for a CPU)
    or ``"full"`` (every shape the issue asks for)."""

    name: str
    title: str
    cases: Callable[[torch.device, str], Iterator[Case]]
    steps: Callable[[str], int]
    #: its kernels allocate per block of rows on CPU: bench them in both glibc malloc
    #: states (see :mod:`ditops.bench.harness`)
    malloc_states: bool = False


def glibc() -> bool:
    """Whether this process runs on glibc (whose malloc states the CPU suites compare)."""
    import platform

    return platform.libc_ver()[0] == "glibc"


def run_in_other_malloc_state(
    args: argparse.Namespace, name: str, current: str
) -> list[dict[str, Any]]:
    """Suite ``name`` run again by a child ``ditops bench`` in the other malloc state."""
    other = "grows" if current == "fixed" else "fixed"
    print(
        f"ditops bench: {name} again in a child process, malloc {other} "
        f"({harness.MALLOC_STATES[other]})",
        file=sys.stderr,
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rows.json")
        argv = [sys.executable, "-m", "ditops", "bench", name, "--size", args.size]
        argv += ["--device", "cpu", "--min-seconds", str(args.min_seconds)]
        argv += ["--malloc", "current", "--json", path]
        if args.no_progress:
            argv.append("--no-progress")
        status = harness.run_child(argv, harness.malloc_env(other))
        if status != 0:
            print(f"ditops bench: the {other} run of {name} failed ({status})", file=sys.stderr)
            return []
        with open(path, encoding="utf-8") as f:
            rows: list[dict[str, Any]] = json.load(f)["rows"]
    return rows
