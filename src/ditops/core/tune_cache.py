"""What tuned choices are valid for, and where they are kept (:mod:`ditops.core.tune`).

The machine fingerprint (CPU model and the flags that decide kernels, GPU name, torch and
ditops versions, intra-op threads), the cache file named after it, and one tuned choice.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from ditops import config
from ditops._version import __version__
from ditops.platform import cpu_flags as all_cpu_flags
from ditops.platform import cpuinfo

#: CPU flags that decide which kernels are fast (x86 names from /proc/cpuinfo).
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16")


def cpu_flags() -> frozenset[str]:
    """The :data:`CPU_FLAGS` this CPU has (empty where /proc/cpuinfo is not readable)."""
    return all_cpu_flags() & frozenset(CPU_FLAGS)


def _cpu_model() -> str:
    return cpuinfo("model name") or platform.processor() or platform.machine()


@functools.cache
def fingerprint() -> dict[str, str]:
    """What makes tuned choices valid: the machine and the software (see module doc)."""
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return {
        "cpu": _cpu_model(),
        "cpu_flags": ",".join(sorted(cpu_flags())),
        "gpu": gpu,
        "torch": torch.__version__,
        "ditops": __version__,
        "threads": str(torch.get_num_threads()),
    }


@functools.cache
def fingerprint_id() -> str:
    """A short hash of :func:`fingerprint` (the cache file's name)."""
    text = json.dumps(fingerprint(), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_file(cfg: config.Config | None = None) -> Path:
    """The cache file for this machine under the settings' cache directory
    (:class:`CacheDirError`, an OSError, when the folder cannot be named)."""
    cfg = cfg or config.get()
    return _cache_file(cfg.cache_dir, os.environ.get("XDG_CACHE_HOME", ""))


class CacheDirError(OSError):
    """The cache folder cannot be named (``~user`` of an unknown user, no home): the
    tuner warns once and keeps its choices in memory only."""


@functools.lru_cache(maxsize=16)
def _cache_file(cache_dir: str, xdg: str) -> Path:
    try:
        if cache_dir:
            root = Path(cache_dir).expanduser()
        else:
            root = (Path(xdg) if xdg else Path.home() / ".cache") / "ditops"
    except RuntimeError as exc:  # expanduser / home(): no such user, no home
        where = f"DITOPS_CACHE_DIR={cache_dir!r}" if cache_dir else "the home folder"
        raise CacheDirError(f"{where} cannot be used: {exc}") from None
    return root / f"tune-{fingerprint_id()}.json"


@dataclass(frozen=True)
class Choice:
    """One tuned shape class: the winner, the competitors and their best times (ms)."""

    winner: str
    candidates: tuple[str, ...]
    times_ms: dict[str, float]
    load: float  # 1-minute load average per core when measured (-1: unknown)
    source: str = "measured"  # or "cache"

    def why(self) -> str:
        """In words: the times that made the choice."""
        times = ", ".join(
            f"{n.removeprefix('forward_')} {t:.3g} ms" for n, t in sorted(self.times_ms.items())
        )
        return f"{times} (load {self.load:.2f}/core, {self.source})"
