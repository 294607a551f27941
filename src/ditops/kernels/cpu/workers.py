"""Blocks of one kernel call shared out to every core, never waiting on a descheduled one.

A blocked exact kernel is a chain of small ATen calls per block of rows. Run with the
process's intra-op threads, each of those calls is an OpenMP region ending in a barrier:
dozens of barriers per call, each waiting for a worker the OS may have descheduled (a
busy neighbour), which made the kernels 0.1-0.6x their meaning on a loaded 2-core EPYC.
Run on one thread they hold under load but leave the other core idle on a quiet machine.

So here the blocks are handed out one at a time from a shared counter: the calling thread
and :func:`workers` - 1 helper threads (persistent, started on first use) each take the
next unclaimed block, run it with one intra-op thread (ATen releases the GIL inside each
call, so the threads run at once), and take another. The only wait is at the end, for a
block a helper has claimed and not finished: one block, whatever the load. A helper the
OS does not run in time claims nothing (the caller takes every block itself), so a call
never waits for a helper to start. Each worker runs its blocks inside its own
:func:`ditops.kernels.cpu.blocks.scratch`, under ``no_grad`` and the caller's inference
mode. Blocks must write disjoint parts of the output: which thread runs a block changes
no bit of it.
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from ditops.kernels.cpu import blocks

#: Threads that run a call's blocks, the caller included (None: torch's intra-op thread
#: count, read at each call). 1 runs every block on the calling thread.
WORKERS: int | None = None

#: Calls with fewer blocks run on the calling thread alone (handing out costs more).
MIN_BLOCKS = 2

T = TypeVar("T")
Body = Callable[[blocks.Scratch], Callable[[int], None]]


def workers() -> int:
    """Threads a call's blocks are shared between, the calling thread included."""
    n = torch.get_num_threads() if WORKERS is None else WORKERS
    return max(1, n)


class _Job:
    """One call's blocks: a counter of the next block, the blocks in flight, the first error."""

    def __init__(self, n: int, body: Body, inference: bool) -> None:
        self.n = n
        self.body = body
        self.inference = inference
        self.lock = threading.Lock()
        self.next = 0
        self.active = 0  # blocks claimed and not finished
        self.error: BaseException | None = None
        self.idle = threading.Event()  # set when every claimed block is finished
        self.idle.set()

    def claim(self) -> int:
        """The next block's index, counted as in flight, or -1 when none is left."""
        with self.lock:
            if self.next >= self.n:
                return -1
            i = self.next
            self.next += 1
            self.active += 1
            self.idle.clear()
            return i

    def finish(self, error: BaseException | None) -> None:
        with self.lock:
            self.active -= 1
            if error is not None and self.error is None:
                self.error = error
                self.next = self.n  # nobody starts another block
            if self.active == 0:
                self.idle.set()

    def work(self) -> None:
        """Claim and run blocks until none is left (in the worker's own scratch)."""
        if self.next >= self.n:  # a late helper: nothing to set up
            return
        with blocks.scratch() as scratch:
            run: Callable[[int], None] | None = None
            while (i := self.claim()) >= 0:
                try:
                    if run is None:
                        run = self.body(scratch)
                    run(i)
                except BaseException as e:  # noqa: BLE001 - handed to the caller, who raises it
                    self.finish(e)
                    return
                self.finish(None)


class _Helper(threading.Thread):
    def __init__(self) -> None:
        super().__init__(name="ditops-cpu-worker", daemon=True)
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()

    def run(self) -> None:
        _local.inside = True  # a kernel called from a block runs on this thread
        with blocks.kernel_threads(1):
            while (job := self.jobs.get()) is not None:
                with torch.inference_mode(job.inference):
                    job.work()
                del job  # do not keep the call's tensors alive while waiting


_helpers: list[_Helper] = []
_helpers_lock = threading.Lock()


def _get_helpers(n: int) -> list[_Helper]:
    with _helpers_lock:
        while len(_helpers) < n:
            h = _Helper()
            h.start()
            _helpers.append(h)
        return _helpers[:n]


@atexit.register
def _stop_helpers() -> None:
    """Let the helpers return before the interpreter shuts down: a daemon thread stopped
    by the shutdown inside a C++ call aborts the process ("terminate called without an
    active exception")."""
    with _helpers_lock:
        for h in _helpers:
            h.jobs.put(None)
        for h in _helpers:
            h.join(timeout=5)
        _helpers.clear()


def _forget_helpers() -> None:
    """In a forked child the helper threads do not exist: start new ones when needed."""
    global _helpers_lock
    _helpers.clear()
    _helpers_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_helpers)

_local = threading.local()


def run_blocks(n: int, body: Body) -> None:
    """Run blocks ``0 .. n-1``: ``body(scratch)`` gives each worker its ``run(i)``.

    Returns when every block has run; an exception raised by a block (in whichever
    thread) is raised here after the blocks in flight finish. A call made from inside a
    block (a kernel run in a hook, say) runs its blocks on its own thread.
    """
    helpers = workers() - 1
    if helpers <= 0 or n < MIN_BLOCKS or getattr(_local, "inside", False):
        with blocks.scratch() as scratch:
            run = body(scratch)
            for i in range(n):
                run(i)
        return
    job = _Job(n, body, torch.is_inference_mode_enabled())
    for h in _get_helpers(min(helpers, n - 1)):
        h.jobs.put(job)
    _local.inside = True
    try:
        job.work()
    finally:
        _local.inside = False
    job.idle.wait()
    if job.error is not None:
        raise job.error


def run_items(items: Sequence[T], body: Callable[[blocks.Scratch], Callable[[T], None]]) -> None:
    """:func:`run_blocks` over a list of blocks: each worker's ``run(item)``."""

    def per_worker(scratch: blocks.Scratch) -> Callable[[int], None]:
        run = body(scratch)
        return lambda i: run(items[i])

    run_blocks(len(items), per_worker)
