"""Run a function on several CPU processes joined in a gloo process group, from a test.

The processes are forked from the test process, so they start with torch, diffusers and
ditops already imported (a spawned one spends ~9 s of CPU importing them; import the
diffusers classes a test uses in the test module, since diffusers imports its submodules
lazily) and the function may be a closure. Each process uses one thread (the CI machine
has 2 cores), runs inside :func:`ditops.integrations.shared.parallel.cpu_shims` (the two
work-arounds diffusers 0.42 needs without an accelerator: see its docstring) and sends
back what the function returns (plain data) or its traceback. A process that hangs (a
collective its peer never joins) is killed after ``timeout`` seconds and the test fails.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch


def _entry(
    rank: int,
    world_size: int,
    store: str,
    fn: Callable[[int, int], Any],
    results: Any,
    timeout: float,
) -> None:
    import torch.distributed as dist

    from ditops.integrations.shared.parallel import cpu_shims

    torch.set_num_threads(1)  # one thread per rank, as OMP_NUM_THREADS=1 would give
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        with cpu_shims():
            value = fn(rank, world_size)
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - any failure goes to the parent, which re-raises it
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_group(fn: Callable[[int, int], Any], world_size: int, timeout: float = 240) -> list[Any]:
    """``fn(rank, world_size)`` on ``world_size`` gloo ranks; the return values by rank."""
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_entry, args=(r, world_size, store, fn, results, timeout))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        got: dict[int, tuple[bool, Any]] = {}
        try:
            while len(got) < world_size:
                try:
                    rank, ok, value = results.get(timeout=timeout)
                except queue.Empty:
                    raise AssertionError(
                        f"ranks {sorted(set(range(world_size)) - set(got))} sent nothing in "
                        f"{timeout} s (a hang?)"
                    ) from None
                got[rank] = (ok, value)
                if not ok:
                    break  # the others may be waiting for it in a collective
        finally:
            for p in procs:
                p.join(timeout=5 if len(got) == world_size else 0.1)
                if p.is_alive():
                    p.kill()
                    p.join()
    failed = {r: v for r, (ok, v) in got.items() if not ok}
    if failed:
        rank, tb = next(iter(sorted(failed.items())))
        raise AssertionError(f"rank {rank} of {world_size} failed:\n{tb}")
    return [got[r][1] for r in range(world_size)]
