"""Tuning on for one test: this thread's settings (as config.override) with the cache in
a fresh folder, every tuned choice and plan forgotten before and after."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from ditops import config
from ditops.core.registry import reset_state


@contextlib.contextmanager
def tuning_on(cache_dir: Path) -> Iterator[Path]:
    reset_state()
    saved = getattr(config._local, "override", None)
    config._local.override = replace(config.get(), tune="on", cache_dir=str(cache_dir))
    try:
        yield cache_dir
    finally:
        config._local.override = saved
        reset_state()
