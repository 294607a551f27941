"""The registry of benchmark suites ``ditops bench`` can run.

A suite is a function ``(device, size) -> Iterator[Case]`` plus how many timed steps it
makes (for the progress bar). ``size`` is ``"small"`` (the default: a minute or two on a
2-core CPU) or ``"full"`` (every shape the issue asks for).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ditops.bench.harness import Case

SIZES = ("small", "full")


@dataclass(frozen=True)
class Suite:
    name: str
    title: str
    cases: Callable[[torch.device, str], Iterator[Case]]
    steps: Callable[[str], int]
    #: its kernels allocate per block of rows on CPU: bench them in both glibc malloc
    #: states (see :mod:`ditops.bench.harness`)
    malloc_states: bool = False


_SUITES: dict[str, Suite] = {}


def register_suite(suite: Suite) -> Suite:
    if suite.name in _SUITES:
        raise ValueError(f"a benchmark suite named {suite.name!r} already exists")
    _SUITES[suite.name] = suite
    return suite


def all_suites() -> dict[str, Suite]:
    """Suites by name, importing the suite modules on first call."""
    from ditops.bench import layer_norm  # noqa: F401 - registers itself

    for module in ("modulation", "attention", "masks", "qk_norm_rope"):
        try:
            __import__(f"ditops.bench.{module}")
        except ModuleNotFoundError as exc:
            if exc.name != f"ditops.bench.{module}":
                raise
    return dict(_SUITES)
