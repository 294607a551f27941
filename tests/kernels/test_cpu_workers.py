"""Blocks shared between the calling thread and helper threads (kernels/cpu/workers.py).

What the scheme promises: every block runs exactly once; the helpers really take blocks;
a helper that is busy (descheduled, as under a busy neighbour) never holds a call up;
an error in any block reaches the caller; a block sees the caller's inference mode and
no grad; the kernels give the same bits whichever thread runs which block.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F

from ditops import config
from ditops.kernels.cpu import blocks, workers
from ditops.kernels.cpu import layer_norm as LN
from ditops.kernels.cpu import modulation as K
from ditops.kernels.cpu import qk_norm_rope as QK
from ditops.ops.qk_norm_rope import qk_norm_rope


@pytest.fixture
def two_workers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(workers, "WORKERS", 2)
    yield


def _recording(seen: list[tuple[int, int]], pause: float = 0.0) -> workers.Body:
    def body(scratch: blocks.Scratch) -> Callable[[int], None]:
        def run(i: int) -> None:
            seen.append((i, threading.get_ident()))
            if pause:
                time.sleep(pause)  # releases the GIL, as an ATen call does

        return run

    return body


def test_every_block_runs_once_and_the_helper_takes_some(two_workers: None) -> None:
    seen: list[tuple[int, int]] = []
    workers.run_blocks(40, _recording(seen, pause=0.002))
    assert sorted(i for i, _ in seen) == list(range(40))
    threads = {t for _, t in seen}
    assert threading.get_ident() in threads
    assert len(threads) == 2, "the helper ran no block"


def test_one_worker_runs_everything_on_the_calling_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(workers, "WORKERS", 1)
    seen: list[tuple[int, int]] = []
    workers.run_blocks(10, _recording(seen, pause=0.001))
    assert [i for i, _ in seen] == list(range(10))
    assert {t for _, t in seen} == {threading.get_ident()}


class _Stuck:
    """A job that keeps a helper busy until released: the helper is, for the caller, as
    good as descheduled."""

    inference = False

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()

    def work(self) -> None:
        self.started.set()
        self.release.wait(30)


def test_a_busy_helper_never_holds_a_call_up(two_workers: None) -> None:
    stuck = _Stuck()
    (helper,) = workers._get_helpers(1)
    helper.jobs.put(stuck)  # type: ignore[arg-type]
    try:
        assert stuck.started.wait(10)
        seen: list[tuple[int, int]] = []
        done = threading.Event()

        def call() -> None:
            workers.run_blocks(20, _recording(seen, pause=0.001))
            done.set()

        t = threading.Thread(target=call)
        t.start()
        assert done.wait(10), "the call waited for the busy helper"
        t.join()
        assert sorted(i for i, _ in seen) == list(range(20))
        assert {tid for _, tid in seen} == {t.ident}
    finally:
        stuck.release.set()


def test_an_error_in_a_helpers_block_reaches_the_caller(two_workers: None) -> None:
    caller = threading.get_ident()
    ran: list[int] = []

    def body(scratch: blocks.Scratch) -> Callable[[int], None]:
        def run(i: int) -> None:
            time.sleep(0.002)
            if threading.get_ident() != caller:
                raise ValueError(f"block {i} failed")
            ran.append(i)

        return run

    with pytest.raises(ValueError, match="failed"):
        workers.run_blocks(200, body)
    assert len(ran) < 199  # no block starts once one failed


def test_an_error_on_the_calling_thread_is_raised_after_the_helpers_finish(
    two_workers: None,
) -> None:
    caller = threading.get_ident()
    active = []

    def body(scratch: blocks.Scratch) -> Callable[[int], None]:
        def run(i: int) -> None:
            if threading.get_ident() == caller and i > 3:
                raise RuntimeError("caller's block failed")
            active.append(1)
            time.sleep(0.005)
            active.pop()

        return run

    with pytest.raises(RuntimeError, match="caller's block"):
        workers.run_blocks(100, body)
    assert not active  # no block still running when the error surfaced


@pytest.mark.parametrize("inference", [False, True])
def test_blocks_see_the_callers_inference_mode_and_no_grad(
    two_workers: None, inference: bool
) -> None:
    modes: set[tuple[bool, bool, int]] = set()

    def body(scratch: blocks.Scratch) -> Callable[[int], None]:
        def run(i: int) -> None:
            time.sleep(0.002)
            modes.add(
                (
                    torch.is_inference_mode_enabled(),
                    torch.is_grad_enabled(),
                    torch.get_num_threads(),
                )
            )

        return run

    with torch.inference_mode(inference):
        workers.run_blocks(30, body)
    expected_threads = blocks.THREADS or torch.get_num_threads()
    assert modes == {(inference, False, expected_threads)}


def test_a_call_from_inside_a_block_runs_on_its_own_thread(two_workers: None) -> None:
    inner: list[tuple[int, int]] = []
    outer: list[tuple[int, int]] = []

    def body(scratch: blocks.Scratch) -> Callable[[int], None]:
        def run(i: int) -> None:
            seen: list[tuple[int, int]] = []
            workers.run_blocks(4, _recording(seen))
            assert {t for _, t in seen} == {threading.get_ident()}
            inner.extend(seen)
            outer.append((i, threading.get_ident()))
            time.sleep(0.002)

        return run

    workers.run_blocks(8, body)
    assert sorted(i for i, _ in outer) == list(range(8))
    assert len(inner) == 32


def _kernel_in_child(q: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    # GNU OpenMP cannot start a thread team in a forked child of a process that used one
    # (the parent's tests did): the reference runs on one intra-op thread.
    torch.set_num_threads(1)
    x = torch.randn(64, 32, dtype=torch.bfloat16)
    ref = F.layer_norm(x.float(), (32,)).to(torch.bfloat16)
    out = LN.fp32_layer_norm(x, (32,), None, None, 1e-5, True)
    q.put(bool(torch.equal(out, ref)))


def test_a_forked_child_gets_helpers_of_its_own(
    two_workers: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(LN, "_BLOCK_BYTES", 4 * 32 * 3)
    workers.run_blocks(4, _recording([]))  # helpers started in the parent
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_kernel_in_child, args=(q,))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    assert q.get(timeout=5) is True


# --- the kernels: the same bits with one worker and two, over many blocks -----------------


def _both(fn: Callable[[], object], monkeypatch: pytest.MonkeyPatch) -> None:
    outs = []
    for n in (1, 2, 2):
        monkeypatch.setattr(workers, "WORKERS", n)
        out = fn()
        outs.append(out if isinstance(out, tuple) else (out,))
    for other in outs[1:]:
        for a, b in zip(outs[0], other, strict=True):
            assert torch.equal(a, b)


def test_kernels_give_the_same_bits_with_one_and_two_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    C = 96
    monkeypatch.setattr(LN, "_BLOCK_BYTES", 4 * C * 3)
    monkeypatch.setattr(K, "_BLOCK_BYTES", 4 * C * 3)
    monkeypatch.setattr(QK, "_BLOCK_BYTES", 4 * 2 * C * 3)
    x = torch.randn(2, 200, C, dtype=torch.bfloat16)
    r = torch.randn(2, 200, C, dtype=torch.bfloat16)
    s, t, g = (torch.randn(2, 1, C) * 0.1 for _ in range(3))
    w = torch.randn(C) + 1
    q, k = (torch.randn(1, 200, 2, C // 2, dtype=torch.bfloat16) for _ in range(2))
    ang = torch.rand(1, 200, 1, C // 4) * 6.28
    _both(lambda: LN.fp32_layer_norm(x, (C,), w, None, 1e-6, True), monkeypatch)
    _both(lambda: K.layer_norm_scale_shift(x, w, w, s, t, 1e-6, torch.bfloat16, True), monkeypatch)
    _both(lambda: K.gated_residual(r, x, g, True), monkeypatch)
    _both(
        lambda: K.scale_residual_layer_norm_scale_shift(
            r, x, g, None, None, s, t, 1e-6, torch.bfloat16, True
        ),
        monkeypatch,
    )
    qk = qk_norm_rope.op
    with config.override(precision="exact"):
        call = qk.prepare(q, k, w, w, ang.cos(), ang.sin(), 1e-6, across_heads=True)
        _both(lambda: qk.forward_cpu(call), monkeypatch)
