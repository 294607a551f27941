"""torch.compile of a patched Wan model before any eager call (issue 10, item 10).

Regression: dispatch took a threading lock while planning a path, so compiling a
patched model that had not yet run eagerly failed with fullgraph=True ("Dynamo does not
know how to enter a `lock` context manager"), both for ``torch.compile(model)`` and for
diffusers' regional ``compile_repeated_blocks``. Here every patch mode compiles first,
with ``fullgraph=True`` and ``error_on_recompile``, and a second call reuses the graph.

The backend is ``aot_eager``: it runs dynamo's tracing (where the lock failed), the
guards and AOT tracing through the kernels' fake implementations, without inductor's
code generation (a minute per model on 2 cores; the op tests compile with inductor).
"""

from __future__ import annotations

import pytest
import torch

import ditops
from ditops import config
from ditops.attention.schedule import BlockSparseConfig
from ditops.custom_op import reset_state
from tests.integrations.test_diffusers_wan import FAST_REL_TOL, inputs, run, tiny_wan

SPARSE = BlockSparseConfig(sparsity=0.5, skip_first_steps=1, block_size=32, stride=4)
MODES = {
    "exact": {"precision": "exact"},
    "fast": {"precision": "fast"},
    "attention": {"norms": False, "attention": SPARSE},
    "both": {"precision": "exact", "attention": SPARSE},
}
CASES = [(m, "model") for m in MODES] + [("exact", "blocks"), ("both", "blocks")]


@pytest.fixture
def as_in_a_fresh_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """No plan made, no backend probed, the environment not read yet: what a process
    that compiles before its first eager call has."""
    reset_state()
    monkeypatch.setattr(config, "_process", None)
    torch._dynamo.reset()
    yield
    reset_state()


@pytest.mark.parametrize(("mode", "how"), CASES)
def test_compile_first_fullgraph_without_recompiles(
    mode: str, how: str, as_in_a_fresh_process: None
) -> None:
    x = inputs(frames=4, hw=16)  # 256 tokens: 8 blocks of 32, sparse at step 1
    model = tiny_wan(keep_fp32=True)
    ditops.patch(model, **MODES[mode])
    if how == "model":
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    else:
        model.compile_repeated_blocks(fullgraph=True, backend="aot_eager")
        compiled = model
    with torch._dynamo.config.patch(error_on_recompile=True):
        first = run(compiled, step=1, **x)  # the first call ever: traced here
        again = run(compiled, step=1, **x)
    assert torch.equal(first, again)
    eager = tiny_wan(keep_fp32=True)
    ditops.patch(eager, **MODES[mode])
    want = run(eager, step=1, **x)
    if mode == "exact":
        assert torch.equal(first, want)
    else:
        rel = (first.float() - want.float()).abs().max() / want.float().abs().max()
        assert rel <= FAST_REL_TOL, rel


@pytest.mark.parametrize("capability", ["AVX2", "AVX512"])
def test_sparse_fullgraph_at_a_new_resolution_and_either_cpu_estimate(
    capability: str, monkeypatch: pytest.MonkeyPatch, as_in_a_fresh_process: None
) -> None:
    """What the README states: sparse attention compiles with fullgraph=True (every
    estimate), on both CPU estimate paths (AVX2: fp32 block scores; AVX-512: the meaning),
    and a second resolution recompiles (dynamic shapes) and still runs. Before: the
    non-finite torch.cond failed on symbolic output strides at the second resolution. (The
    capability query is replaced here; that dynamo takes the real one as a constant is the
    marker checked first.)"""
    from ditops.platform import cpu_half_matmuls_slow
    from ditops.tracing import MARKER

    assert getattr(cpu_half_matmuls_slow, MARKER, False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    model = tiny_wan(keep_fp32=True)
    ditops.patch(model, precision="exact", attention=SPARSE)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    for hw in (16, 24):
        x = inputs(frames=4, hw=hw)
        got = run(compiled, step=1, **x)
        assert torch.equal(got, run(model, step=1, **x))
