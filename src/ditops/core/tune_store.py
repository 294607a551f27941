"""The tuner's cache file on disk (:mod:`ditops.core.tune`): reading, writing, pruning.

As users expect of cuDNN's, Triton's and inductor's caches:

* **A bad cache never breaks a run.** Whatever the file or its folder holds (an unknown
  user's home in ``DITOPS_CACHE_DIR``, corrupt or deeply nested JSON, a folder that
  cannot be written) the problem comes back as one line and the choices stay in memory
  only; a file said to be kept in memory only is then never written over.
* **A format version** (:data:`FORMAT`) in every file. A file of another format is
  ignored with one line: an older one is replaced by the next write, a newer one (a
  newer ditops sharing the folder) is left alone.
* **The load a choice was timed under** is kept with it (the 1-minute load average per
  core): a choice timed under much heavier load than now (:data:`HEAVY_LOAD`) is timed
  again, in ``on`` mode, as it may have been decided by a neighbour's noise.
* **One file per machine fingerprint** (its name is the fingerprint's hash); after each
  write the files this machine's earlier ditops or torch versions wrote (same CPU and
  GPU, another version: dead after an upgrade) and leftover temporary files are
  pruned. Other machines' files (a shared home) are left alone.
* ``ditops tune --clear`` removes this machine's file (:func:`clear`).
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ditops.core.tune_cache import Choice, fingerprint

#: The cache file's format; 2: records carry ``load_per_core`` (1: no version field).
FORMAT = 2
#: A recorded choice is timed again when its load per core exceeded now's by this.
HEAVY_LOAD = 1.0
#: Temporary files older than this (seconds) are a crashed writer's: removed.
STALE_TMP_S = 3600.0


def load_per_core() -> float:
    """The 1-minute load average per usable core (-1 where the OS does not say)."""
    if not hasattr(os, "getloadavg"):
        return -1.0
    try:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
        return round(os.getloadavg()[0] / max(cores or os.cpu_count() or 1, 1), 3)
    except OSError:
        return -1.0


def timed_under_heavier_load(choice: Choice, now: float | None = None) -> bool:
    """Whether ``choice`` was timed under much heavier load than now (:data:`HEAVY_LOAD`)."""
    if choice.load < 0:
        return False
    now = load_per_core() if now is None else now
    return now >= 0 and choice.load - now > HEAVY_LOAD


@dataclass
class Read:
    """What a cache file held: its choices, and a problem in one line (or "")."""

    choices: dict[str, Choice] = field(default_factory=dict)
    problem: str = ""
    #: False: the file must not be written over (unreadable, or a newer format).
    writable: bool = True


def read(path: Path) -> Read:
    """Read a cache file; never raises (a problem is returned in words)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return Read()
    except (OSError, ValueError, RecursionError, MemoryError) as exc:
        text = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        return Read(problem=f"cannot read {path}: {text}", writable=False)
    if not isinstance(data, dict) or not isinstance(data.get("choices"), dict):
        return Read(problem=f"{path} is not a ditops tuning cache", writable=False)
    found = data.get("format")
    if found != FORMAT:
        newer = isinstance(found, int) and not isinstance(found, bool) and found > FORMAT
        what = f"format {found}" if found is not None else "no format version"
        action = "left alone" if newer else "replaced at the next write"
        return Read(
            problem=f"{path} has {what} (this ditops reads {FORMAT}): ignored, {action}",
            writable=not newer,
        )
    return Read(choices=_records(data["choices"]))


def _records(entries: dict[str, Any]) -> dict[str, Choice]:
    out: dict[str, Choice] = {}
    for key, e in entries.items():
        try:
            out[str(key)] = Choice(
                str(e["winner"]),
                tuple(map(str, e["candidates"])),
                {str(k): float(v) for k, v in e["times_ms"].items()},
                float(e.get("load_per_core", -1.0)),
                "cache",
            )
        except (KeyError, TypeError, ValueError, AttributeError):
            continue  # one bad record does not spoil the others
    return out


def record(choice: Choice) -> dict[str, Any]:
    """A choice as the file keeps it."""
    return {
        "winner": choice.winner,
        "candidates": list(choice.candidates),
        "times_ms": dict(choice.times_ms),
        "load_per_core": choice.load,
    }


def write(path: Path, mine: dict[str, Choice]) -> None:
    """Merge ``mine`` into the file (atomic replace), then prune; raises OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    old = read(path)
    merged = {k: record(c) for k, c in old.choices.items()}
    merged.update((k, record(c)) for k, c in mine.items())
    payload = {"format": FORMAT, "fingerprint": fingerprint(), "choices": merged}
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(payload, indent=1, sort_keys=True), encoding="utf-8")
    os.replace(tmp, path)
    prune(path)


def _same_machine_older(other: Path, mine: dict[str, str]) -> bool:
    try:
        found = json.loads(other.read_text(encoding="utf-8")).get("fingerprint")
    except (OSError, ValueError, RecursionError, AttributeError):
        return False  # not ours to judge: left alone
    if not isinstance(found, dict):
        return False
    same_machine = all(found.get(k) == mine[k] for k in ("cpu", "cpu_flags", "gpu", "threads"))
    return same_machine and any(found.get(k) != mine[k] for k in ("ditops", "torch"))


def prune(path: Path) -> list[Path]:
    """Remove this machine's files of other ditops/torch versions and stale temporary
    files beside ``path``; returns what was removed (never raises)."""
    removed: list[Path] = []
    mine = fingerprint()
    try:
        siblings = list(path.parent.glob("tune-*"))
    except OSError:
        return removed
    for other in siblings:
        try:
            if other == path:
                continue
            if other.name.endswith(".tmp"):
                stale = time.time() - other.stat().st_mtime > STALE_TMP_S
            else:
                stale = other.suffix == ".json" and _same_machine_older(other, mine)
            if stale:
                other.unlink()
                removed.append(other)
        except OSError:
            continue
    return removed


def clear(path: Path) -> list[Path]:
    """Remove this machine's cache file and what :func:`prune` removes; what went."""
    removed = prune(path)
    try:
        path.unlink()
        removed.insert(0, path)
    except FileNotFoundError:
        pass
    return removed
