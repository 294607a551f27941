"""How a kernel launch picks its config: the hook :mod:`ditops.core.tune` fills.

Kernels (``ditops.kernels``) may not import the op core, and the core may not import
kernels, so the one function between them lives here: a kernel calls :func:`launch` with
its candidate configs, the static one first; with the tuner installed (importing the op
core installs it) the fastest config for the call's shape class runs, else the first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Config = dict[str, Any]
#: ``(kernel, kind, shape, configs, run) -> None``; set by :mod:`ditops.core.tune`.
Tuner = Callable[[str, str, tuple[int, ...], list[Config], Callable[[Config], None]], None]

tuner: Tuner | None = None


def launch(
    kernel: str,
    kind: str,
    shape: tuple[int, ...],
    configs: list[Config],
    run: Callable[[Config], None],
    same_bits: bool = False,
) -> None:
    """``run(config)`` with the tuned config for this shape class, else ``configs[0]``.

    ``same_bits``: every config gives ``configs[0]``'s bits (no reduction changes its
    order). Only then may the tuner choose among them: timing never changes a result
    (:mod:`ditops.core.same_bits`). Otherwise ``configs[0]`` runs."""
    if tuner is None or not same_bits:
        run(configs[0])
    else:
        tuner(kernel, kind, shape, configs, run)


def warps_and_rows(block_m: int, num_warps: int) -> list[Config]:
    """Launch configs of a row kernel for the tuner: the measured default first, then
    half and twice the warps, and half the rows per program. Rows never mix, but the
    order of a row's reduction may change with the warps and the tile, so they are not
    passed as ``same_bits``: the first runs (timing would change a result)."""
    found: list[Config] = []
    for bm in (block_m, block_m // 2):
        for nw in (num_warps, num_warps * 2, num_warps // 2):
            cfg = {"BLOCK_M": bm, "num_warps": nw}
            if bm >= 1 and 1 <= nw <= 16 and cfg not in found:
                found.append(cfg)
    return found
