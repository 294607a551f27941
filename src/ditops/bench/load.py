"""What a benchmark says about the machine it ran on, and a busy neighbour to run beside.

A serving machine is rarely quiet, and the exact CPU kernels once lost their gain when
another process kept a core busy (1.11x quiet, 0.72x loaded on a 2-core EPYC). So every
figure says how loaded the machine was when it started (:func:`header`), and
:func:`busy_neighbour` runs the same comparison with one core kept busy.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator


def load_average() -> float:
    """The 1-minute load average (-1 where the OS has none)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else -1.0


@contextlib.contextmanager
def busy_neighbour(on: bool = True) -> Iterator[None]:
    """A process spinning on one core while the block runs (nothing when ``on`` is False).

    A plain Python loop: one runnable thread that never sleeps, as a neighbouring job
    computing would be. Killed when the block ends, whatever happens in it.
    """
    if not on:
        yield
        return
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    time.sleep(0.5)  # let the scheduler see it running
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def blocked_kernel_threads(n: int | None) -> Iterator[None]:
    """Run the blocked CPU kernels with ``n`` intra-op threads inside the block (None: the
    process's), to compare threading models (:data:`ditops.kernels.cpu.blocks.THREADS`;
    process-wide while the block runs)."""
    from ditops.kernels.cpu import blocks

    old = blocks.THREADS
    blocks.THREADS = n
    try:
        yield
    finally:
        blocks.THREADS = old


@contextlib.contextmanager
def blocked_kernel_workers(n: int | None) -> Iterator[None]:
    """Share the blocked CPU kernels' blocks between ``n`` threads inside the block (None:
    torch's intra-op thread count; 1: the calling thread alone), to compare scheduling
    models (:data:`ditops.kernels.cpu.workers.WORKERS`; process-wide while the block runs)."""
    from ditops.kernels.cpu import workers

    old = workers.WORKERS
    workers.WORKERS = n
    try:
        yield
    finally:
        workers.WORKERS = old


def ratios_to(
    base: str, fns: dict[str, Callable[[], object]], rounds: int, warmup: int = 1
) -> dict[str, tuple[float, float, float]]:
    """Interleaved timing against ``fns[base]``: per variant, the median over rounds of
    base time / variant time within the round (a slow spell hits both), the ratio of
    their best times, and the variant's median seconds. Rounds alternate their order."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    per: dict[str, list[float]] = {k: [] for k in fns}
    secs: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(rounds):
        order = list(fns.items()) if i % 2 == 0 else list(fns.items())[::-1]
        for name, fn in order:
            t0 = time.perf_counter()
            fn()
            secs[name].append(time.perf_counter() - t0)
        for name in fns:
            per[name].append(secs[base][-1] / secs[name][-1])
    return {
        k: (statistics.median(per[k]), min(secs[base]) / min(secs[k]), statistics.median(secs[k]))
        for k in fns
    }


def header(busy: bool = False) -> list[str]:
    """Lines that open a benchmark's output: the machine fingerprint the tuner keys its
    cache on, the load average at start, the tuning mode and whether a neighbour spins."""
    from ditops import config
    from ditops.core import tune, tune_report

    fp = tune.fingerprint()
    cfg = config.get()
    return [
        f"machine: {fp['cpu']} [{fp['cpu_flags'] or 'no x86 flags read'}], gpu {fp['gpu']}, "
        f"torch {fp['torch']}, ditops {fp['ditops']}, {fp['threads']} threads, "
        f"{os.cpu_count()} cores",
        f"load average at start: {load_average():.2f}"
        + (" (plus a busy neighbour: one spinning process for the run)" if busy else ""),
        f"DITOPS_TUNE={cfg.tune}, cache {tune_report.cache_place(cfg)}",
    ]
