"""The blocked CPU kernels' machinery: per-thread scratch, the page probe, and no fresh
memory per block in either state of glibc's allocator."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import ditops
from ditops.kernels.cpu import blocks

ROOT = Path(__file__).resolve().parents[2]


# --- scratch --------------------------------------------------------------------------------


def test_scratch_is_reused_and_grows_to_the_largest_request() -> None:
    blocks.release()
    with blocks.scratch() as s:
        a = s.take(0, 4, 8, torch.float32)
    with blocks.scratch() as s:
        b = s.take(0, 2, 8, torch.bfloat16)
        assert b.data_ptr() == a.data_ptr() and b.shape == (2, 8) and b.is_contiguous()
        c = s.take(0, 8, 8, torch.float32)
    assert blocks.held_bytes() == 8 * 8 * 4
    with blocks.scratch() as s:
        assert s.take(0, 8, 8, torch.float32).data_ptr() == c.data_ptr()
        with pytest.raises(ValueError, match="slot 3"):
            s.take(3, 1, 1, torch.float32)
    blocks.release()
    assert blocks.held_bytes() == 0


def test_scratch_is_per_thread() -> None:
    ptrs: dict[str, int] = {}

    def take(name: str) -> None:
        with blocks.scratch() as s:
            ptrs[name] = s.take(0, 16, 16, torch.float32).data_ptr()

    take("main")
    worker = threading.Thread(target=take, args=("worker",))
    worker.start()
    worker.join()
    assert ptrs["main"] != ptrs["worker"]


def test_nested_scratch_gets_its_own_blocks() -> None:
    with blocks.scratch() as outer:
        a = outer.take(0, 4, 4, torch.float32)
        with blocks.scratch() as inner:
            assert inner.take(0, 4, 4, torch.float32).data_ptr() != a.data_ptr()
        assert outer.take(0, 4, 4, torch.float32).data_ptr() == a.data_ptr()


def test_scratch_made_in_inference_mode_works_outside_it() -> None:
    # An inference tensor kept for later calls would refuse in-place use outside the mode.
    blocks.release()
    m = ditops.FP32LayerNorm(64).to(torch.bfloat16)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    with ditops.override(precision="exact"):
        with torch.inference_mode():
            first = m(x)
        with torch.no_grad():
            assert torch.equal(m(x), first)
        with torch.inference_mode():
            assert torch.equal(m(x), first)


def test_scratch_never_records_autograd_history() -> None:
    with blocks.scratch() as s:
        buf = s.take(0, 2, 4, torch.float32)
        buf.copy_(torch.randn(2, 4, requires_grad=True))
        assert not buf.requires_grad


# --- the page probe and page faults, in fresh processes ------------------------------------


def _run_page_faults(threshold: str | None) -> subprocess.Popen[str]:
    drop = ("MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    if threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = threshold
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    env["OMP_NUM_THREADS"] = "2"
    return subprocess.Popen(
        [sys.executable, "-m", "tests.kernels.page_faults"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _page_fault_problems() -> list[str]:
    """Both allocator states measured in fresh processes; what breaks the claims."""
    procs = {"fixed": _run_page_faults("131072"), "grown": _run_page_faults(None)}
    results = {}
    for state, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err
        results[state] = json.loads(out)
    fixed, grown = results["fixed"], results["grown"]
    problems = []
    # The probe: a fixed threshold hands out fresh pages every time; a grown one recycles.
    if not (fixed["probe"] == [True, True, True] and fixed["probe_after"] is True):
        problems.append(f"fixed-threshold probe {fixed['probe']}, after {fixed['probe_after']}")
    if grown["probe_after"] is not False:
        problems.append("grown-threshold probe still sees fresh pages")
    for state, result in results.items():
        for name, case in result["cases"].items():
            # Only the outputs fault (fresh mmapped tensors with a fixed threshold), and
            # at most the probe's one block ...
            slack = 64 + case["out_pages"] // 50
            if case["faults"] > case["out_pages"] + result["block_pages"] + slack:
                problems.append(f"{state} {name}: {case} (block {result['block_pages']} pages)")
    for name, case in fixed["cases"].items():
        # ... where a LayerNorm call per block faults on every block's output.
        if case["whole"] < case["faults"] + fixed["block_pages"]:
            problems.append(f"fixed {name}, one call per block: {case}")
    return problems


@pytest.mark.slow
@pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc", reason="MALLOC_MMAP_THRESHOLD_ is glibc's setting"
)
def test_no_fresh_pages_per_block_in_either_allocator_state() -> None:
    # This failed once in a full run and not in 10 runs since (cause not pinned down;
    # the OS collapsing transparent huge pages in the background is one candidate), so a
    # miss is measured once more before it counts. A kernel that takes fresh memory per
    # block misses every time.
    problems = _page_fault_problems()
    if problems:
        problems = _page_fault_problems()
    assert not problems, problems


def test_kernel_threads_is_per_thread_and_restored() -> None:
    """The blocked kernels' one intra-op thread is the calling thread's setting only: other
    threads, threads started later and the caller after the kernel keep theirs."""
    import threading

    if blocks._omp() is None:
        pytest.skip("torch is not built with its own libgomp here: kernel_threads does nothing")
    before = torch.get_num_threads()
    seen: dict[str, int] = {}
    with blocks.kernel_threads(1):
        seen["inside"] = torch.get_num_threads()
        t = threading.Thread(target=lambda: seen.update(other=torch.get_num_threads()))
        t.start()
        t.join()
    assert seen["inside"] == 1
    assert seen["other"] == before
    assert torch.get_num_threads() == before


def test_a_kernel_runs_with_blocks_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    from ditops.kernels.cpu import modulation

    seen: list[int] = []
    real = modulation._gated_sum_exact  # called per block, inside the kernel's loop

    def spy(*args):
        seen.append(torch.get_num_threads())
        return real(*args)

    monkeypatch.setattr(modulation, "_gated_sum_exact", spy)
    x = torch.randn(1, 8, 16)
    modulation.gated_residual(x, x, None, True)
    if blocks._omp() is not None:
        assert seen == [blocks.THREADS or torch.get_num_threads()]
    assert torch.get_num_threads() >= 1
