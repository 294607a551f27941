"""Which paths the tuner may choose among: those giving the same bits (``DITOPS_TUNE``).

Timing never changes a result. Which competitor wins depends on the load and the
machine, so if competitors gave different bits, the first call of a shape class (the
static choice's output), later calls (the winner's) and a run that found another cache
file would differ: one block of a sparse mask swapped at a near-tie, a video that
differs from run to run. So the tuner only chooses among paths that give, for the call,
the very bits of the path ``DITOPS_TUNE=off`` takes (the call's *static choice*):

* in ``exact`` precision every usable path promises the meaning's bits, so all compete
  (the meaning too, unless the op opts out: ``meaning_competes``);
* in ``fast`` each path declares what its bits equal (``@path(fast_bits=...)``): the
  meaning's (``"native"``: a path that computes the meaning's expression, such as the
  whole-tensor modulation paths), a name shared with other paths, or, by default, its
  own. A fast kernel that rounds once where the meaning rounds twice, or a mask
  estimate that breaks near-ties its own way, competes with nothing.

A call whose static choice is not among its plan's competitors (a per-call refusal made
another path static) takes the static choice: no winner, no timing. With
``torch.use_deterministic_algorithms(True)`` the tuner is not consulted at all: the
static, declared order runs, as with ``DITOPS_TUNE=off``.

What may differ between machines (docs/tuning.md): in ``fast``, the static choice
itself (a CUDA machine runs the Triton path, a CPU with AMX compiled FlexAttention, one
without the gathered kernel), each within the op's stated tolerance of the meaning.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ditops.core.paths import NATIVE, PathSpec
from ditops.core.tune_cache import Choice


def bits_of(spec: PathSpec | None, precision: str) -> str:
    """The name of the bits a path (``None``: the meaning) gives under ``precision``."""
    if spec is None or precision == "exact":
        return NATIVE
    return spec.fast_bits and _native(spec.fast_bits) or spec.name


def _native(name: str) -> str:
    return NATIVE if name in ("native", NATIVE) else name


def competitors(
    usable: Iterable[PathSpec], precision: str, meaning_competes: bool
) -> tuple[str, ...]:
    """What the tuner times against each other for a plan: the usable paths (in order)
    giving the first one's bits, and the meaning where it gives them too and competes;
    empty when fewer than two (nothing to choose)."""
    specs = list(usable)
    if not specs:
        return ()
    bits = bits_of(specs[0], precision)
    names = [s.name for s in specs if bits_of(s, precision) == bits]
    if meaning_competes and bits == NATIVE:
        names.append(NATIVE)
    return tuple(names) if len(names) > 1 else ()


def applicable(choice: Choice | None, competitors: tuple[str, ...], mode: str) -> Choice | None:
    """A recorded choice, if it may run: its winner gives the call's bits (one of today's
    competitors), and it was timed among today's competitors (``cache`` mode: any)."""
    if choice is None or choice.winner not in competitors:
        return None
    if choice.candidates != competitors and mode != "cache":
        return None
    return choice


def deterministic() -> bool:
    """Whether ``torch.use_deterministic_algorithms(True)`` is in force: then the tuner
    is not consulted (the declared order runs on every machine and load)."""
    return torch.are_deterministic_algorithms_enabled()
