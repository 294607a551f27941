"""Launching a Triton kernel with the fastest of its launch configs for a shape class
(``DITOPS_TUNE``), as ``triton.autotune`` does, but keyed on :mod:`ditops.core.tune`'s
buckets, kept in its cache file and timed by its race."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ditops import config
from ditops.core import same_bits
from ditops.core.tune import bucket, claimed, decide, lookup, race
from ditops.core.tune_devices import device_for_kind


def _config_name(cfg: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(cfg.items()))


def launch_config(
    kernel: str,
    kind: str,
    shape: tuple[int, ...],
    configs: list[dict[str, Any]],
    launch: Callable[[dict[str, Any]], None],
) -> None:
    """Launch a kernel with the fastest of ``configs`` for its shape class (``shape``
    bucketed as tensors' dims are), as ``triton.autotune`` does, but keyed on buckets and
    kept in the same cache file, under the same switch.

    ``configs[0]`` is the static choice (``DITOPS_TUNE=off``, or ``cache`` without a
    record). Every config must give the static config's bits (kernels pass
    ``same_bits=True`` to :func:`ditops.launch.launch`; others never reach here) and
    ``launch(cfg)`` must be safe to repeat (outputs only written). When timing, each config
    warms up and runs :data:`~ditops.core.tune.ROUNDS` timed rounds; the static config runs
    last, so the timed call's outputs are the ones ``off`` would give.
    """
    cfg = config.get()
    if cfg.tune == "off" or len(configs) < 2 or same_bits.deterministic():
        launch(configs[0])
        return
    names = tuple(_config_name(c) for c in configs)
    key = f"{kernel}/{kind}/config/[{','.join(str(bucket(d)) for d in shape)}]"
    choice = lookup(key, cfg)
    if choice is not None and choice.winner in names:
        launch(configs[names.index(choice.winner)])
        return
    if cfg.tune != "on":
        launch(configs[0])
        return
    with claimed(key) as mine:
        if not mine:
            launch(configs[0])
            return
        runs = [(n, functools.partial(launch, c)) for n, c in zip(names, configs, strict=True)]
        # the static config warms up last
        best = race(device_for_kind(kind), key, runs[::-1], warmed=0)
        launch(configs[0])  # ... and runs last: its outputs are the call's
        decide(key, names[0], names, best, cfg)
