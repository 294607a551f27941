"""The tuner's state in words and JSON, for ``ditops info``, ``bench`` and ``tune``."""

from __future__ import annotations

from typing import Any

from ditops import config
from ditops.core.tune import Choice, cache_file, choices, fingerprint
from ditops.core.tune_store import FORMAT


def cache_place(cfg: config.Config | None = None) -> str:
    """The cache file's path, or why there is none (a folder that cannot be named)."""
    try:
        return str(cache_file(cfg))
    except OSError as exc:
        return f"none ({exc}): choices kept in memory only"


def describe(found: dict[str, Choice]) -> list[str]:
    """Lines for people: per shape class, the winner and the times that chose it."""
    lines = []
    for key, c in found.items():
        op, kind, precision, shapes = key.split("/", 3)
        lines.append(f"  {op} {kind} {precision} {shapes}")
        lines.append(f"      -> {c.winner.removeprefix('forward_')}: {c.why()}")
    return lines or ["  (none yet)"]


def report(cfg: config.Config | None = None) -> tuple[dict[str, Any], list[str]]:
    """The tuning state for ``ditops info`` and ``ditops bench``: JSON-able, and lines."""
    cfg = cfg or config.get()
    found = choices(cfg) if cfg.tune != "off" else {}
    where = cache_place(cfg)
    data = {
        "mode": cfg.tune,
        "fingerprint": fingerprint(),
        "cache_file": where,
        "cache_format": FORMAT,
        "choices": {k: {"winner": c.winner, "why": c.why()} for k, c in found.items()},
    }
    lines = [
        f"tuned choices (DITOPS_TUNE={cfg.tune}; where several paths can serve a call, the "
        "fastest measured for its shape class, dtypes and dims rounded to powers of two; "
        f"cache {data['cache_file']}):",
        *(describe(found) if cfg.tune != "off" else ["  (off: the static order)"]),
    ]
    return data, lines
