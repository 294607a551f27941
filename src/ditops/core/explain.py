"""What the dispatcher would choose, per op and device kind, and why: ``ditops info``."""

from __future__ import annotations

from collections.abc import Iterable

from ditops import config
from ditops.core.paths import NATIVE, Decision
from ditops.core.plan import make_plan
from ditops.core.registry import registered_ops
from ditops.platform import DEVICE_KINDS


def explain(
    op: str | None = None,
    device_kinds: Iterable[str] | None = None,
    precision: str | None = None,
) -> list[Decision]:
    """For every registered op (or ``op``) and device kind, the path that would run and why.

    Probing happens here if it has not yet (it imports optional packages). In strict
    mode a missing backend is reported, not raised.
    """
    ops = registered_ops()
    names = [op] if op is not None else sorted(ops)
    for n in names:
        if n not in ops:
            raise KeyError(f"no op named {n!r}; registered ops are: {', '.join(sorted(ops))}")
    kinds = list(device_kinds) if device_kinds is not None else list(DEVICE_KINDS)
    prec = precision or config.get().precision
    if prec not in config.PRECISIONS:
        raise ValueError(f"precision must be one of {config.PRECISIONS}, got {prec!r}")
    cfg = config.get()
    return [
        make_plan(ops[n], kind, prec, cfg, quiet=True).decision for n in names for kind in kinds
    ]


def _cell(d: Decision) -> str:
    if d.chosen != NATIVE:
        # Paths that refuse some calls by their arguments name what serves the rest:
        # "cpu_flex/cpu" (the first where its per-call conditions hold, else the next).
        usable = [c for c in d.candidates if c.usable]
        i = next(i for i, c in enumerate(usable) if c.path == d.chosen)
        names = [d.chosen]
        while usable[i].per_call:
            i += 1
            names.append(usable[i].path if i < len(usable) else NATIVE)
            if i == len(usable):
                break
        return "/".join(n.removeprefix("forward_") for n in names)
    declared = [c for c in d.candidates if c.accepts]  # a path that exists but cannot run
    return "native*" if declared else "native"


def table(decisions: list[Decision], kinds: Iterable[str]) -> list[str]:
    """Op x device kind -> the path taken (``native*``: a fast path exists but cannot run
    here; the reasons are listed below the table; ``a/b``: ``a`` for the calls it takes,
    ``b`` for the others)."""
    kinds = list(kinds)
    ops: dict[str, dict[str, Decision]] = {}
    for d in decisions:
        ops.setdefault(d.op, {})[d.device_kind] = d
    width = max([len("op"), *(len(n) for n in ops)])
    cells = {n: {k: _cell(row[k]) if k in row else "-" for k in kinds} for n, row in ops.items()}
    col = {k: max([len(k), *(len(c[k]) for c in cells.values())]) for k in kinds}
    lines = [f"{'op':<{width}}  " + "  ".join(f"{k:<{col[k]}}" for k in kinds)]
    lines.append("-" * len(lines[0]))
    for name, row in cells.items():
        lines.append(f"{name:<{width}}  " + "  ".join(f"{row[k]:<{col[k]}}" for k in kinds))
    return lines
