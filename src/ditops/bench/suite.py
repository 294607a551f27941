"""What a benchmark suite of ``ditops bench`` is: :class:`Suite`.

A suite module defines one as ``SUITE``; :mod:`ditops.bench.suites` lists the suite
modules by name and imports one when it is asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

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
