"""torch.compile of a patched Wan model before any eager call (issue 10, item 10).

Regression: dispatch took a threading lock while planning a path, so compiling a
patched model that had not yet run eagerly failed with fullgraph=True ("Dynamo does not
know how to enter a `lock` context manager"), both for ``torch.compile(model)`` and for
diffusers' regional ``compile_repeated_blocks``. Here every patch mode compiles first,
with ``fullgraph=True`` and ``error_on_recompile``, and a second call reuses the graph.

The backend is ``aot_eager``: it runs dynamo's tracing (where the lock failed), the
guards and AOT tracing through the kernels' fake implementations, without inductor's
code generation (a minute per model on 2 cores; the op tests compile with inductor).

Issue 25, item 7, below: sparse attention at several resolutions whose budget is scored
(the sort of SymInt keys failed there), compiled before the patch, and what breaks the
graph (mask reuse, HunyuanVideo's sparse attention) refused under fullgraph at the first
trace with an error naming ditops and what to change.
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


# --- issue 25, item 7: sparse attention at new resolutions, scored selections --------------

#: (frames, height = width) of latents whose budget is *not* the forced blocks alone (so
#: the blocks are scored and the budget split over the rows: where the sort of SymInt
#: keys failed): 16, 24, 36 and 19 blocks of 32 (the last one partial). The second
#: changes the frames (dynamo makes that size dynamic), the third the height and width.
SCORED_SHAPES = ((8, 16), (12, 16), (8, 24), (6, 20))


def _budget_is_scored(frames: int, hw: int, cfg: BlockSparseConfig) -> bool:
    from ditops.attention.block_mask import num_blocks
    from ditops.attention.schedule import first_frame_dense_blocks
    from ditops.attention.selection import block_budget

    blocks = num_blocks(frames * (hw // 2) ** 2, cfg.block_size)
    dense = first_frame_dense_blocks((1, 4, frames, hw, hw), (1, 2, 2), cfg.block_size)
    budget = block_budget(blocks, blocks, keep_ratio=cfg.keep_ratio, dense_blocks=dense)
    return not budget.forced_only


@pytest.mark.slow
@pytest.mark.parametrize("method", ["sampled", "antidiagonal_head"])
def test_sparse_fullgraph_scores_blocks_at_several_resolutions(
    method: str, as_in_a_fresh_process: None
) -> None:
    cfg = BlockSparseConfig(
        sparsity=0.5, skip_first_steps=1, block_size=32, stride=4, method=method
    )
    assert all(_budget_is_scored(f, hw, cfg) for f, hw in SCORED_SHAPES)
    model = tiny_wan(keep_fp32=True)
    ditops.patch(model, precision="exact", attention=cfg)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    for frames, hw in SCORED_SHAPES:
        x = inputs(frames=frames, hw=hw)
        got = run(compiled, step=1, **x)
        assert torch.equal(got, run(model, step=1, **x)), (frames, hw)


@pytest.mark.slow
def test_compiled_before_the_sparse_patch_then_a_new_shape(as_in_a_fresh_process: None) -> None:
    cfg = BlockSparseConfig(sparsity=0.5, skip_first_steps=1, block_size=32, stride=4)
    model = tiny_wan(keep_fp32=True)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    run(compiled, step=1, **inputs(frames=8, hw=16))  # traced unpatched
    ditops.patch(compiled, precision="exact", attention=cfg)
    eager = tiny_wan(keep_fp32=True)
    ditops.patch(eager, precision="exact", attention=cfg)
    for frames, hw in SCORED_SHAPES[:3]:
        x = inputs(frames=frames, hw=hw)
        assert torch.equal(run(compiled, step=1, **x), run(eager, step=1, **x)), (frames, hw)


def _message(err: BaseException) -> str:
    """dynamo wraps an error raised while tracing; the text keeps ours."""
    return f"{err}\n{err.__cause__}"


@pytest.mark.slow
def test_mask_reuse_under_fullgraph_is_refused_at_the_first_trace(
    as_in_a_fresh_process: None,
) -> None:
    """estimate_every > 1 keeps masks between steps in Python state, which runs eagerly
    (a graph break): under fullgraph=True the first trace, at a dense step already,
    raises an error naming ditops and what to change. Without fullgraph it works (the
    masks reused as in eager), and the refusal left the model as it was."""
    cfg = BlockSparseConfig(
        sparsity=0.5, skip_first_steps=1, block_size=32, stride=4, estimate_every=2
    )
    model = tiny_wan(keep_fp32=True)
    ditops.patch(model, precision="exact", attention=cfg)
    x = inputs(frames=8, hw=16)
    with pytest.raises(Exception, match="ditops: ") as err:
        run(torch.compile(model, fullgraph=True, backend="aot_eager"), step=0, **x)
    text = _message(err.value)
    assert "estimate_every=2" in text and "estimate_every=1" in text, text
    assert "fullgraph=False" in text, text
    torch._dynamo.reset()
    eager = tiny_wan(keep_fp32=True)
    ditops.patch(eager, precision="exact", attention=cfg)
    compiled = torch.compile(model, backend="aot_eager")
    for step in (0, 1, 2, 3):
        assert torch.equal(run(compiled, step=step, **x), run(eager, step=step, **x)), step


# --- HunyuanVideo's sparse attention: compiles without fullgraph, refuses it clearly ------


def _hunyuan_sparse():
    from tests.integrations.test_diffusers_hunyuan_video import tiny_hunyuan

    cfg = BlockSparseConfig(sparsity=0.5, skip_first_steps=1, block_size=16, stride=4)
    models = [tiny_hunyuan(num_layers=1, num_single_layers=1) for _ in range(2)]
    for m in models:
        ditops.patch(m, precision="exact", attention=cfg)
    return models


def _hunyuan_run(model, step: int | None = None, **kw: torch.Tensor) -> torch.Tensor:
    with (
        torch.inference_mode(),
        model.cache_context("cond", **({} if step is None else {"step_index": step})),
    ):
        return model(**kw, return_dict=False)[0]


@pytest.mark.slow
def test_hunyuan_sparse_compiles_without_fullgraph_at_two_resolutions(
    as_in_a_fresh_process: None,
) -> None:
    """As its pipeline calls it (no step index: steps counted from the timestep, one host
    read, a graph break): a dense then a sparse step at each resolution, as eager."""
    from tests.integrations.test_diffusers_hunyuan_video import inputs as hunyuan_inputs

    model, eager = _hunyuan_sparse()
    compiled = torch.compile(model, backend="aot_eager")
    for frames, hw in ((8, 16), (6, 12)):
        x = hunyuan_inputs(frames=frames, hw=hw)
        later = {**x, "timestep": torch.tensor([400])}
        for kw in (x, later):  # step 0 (dense), step 1 (sparse)
            assert torch.equal(_hunyuan_run(compiled, **kw), _hunyuan_run(eager, **kw))
        assert model._ditops_steps.current() == 1


@pytest.mark.slow
@pytest.mark.parametrize("step_index", [False, True])
def test_hunyuan_sparse_under_fullgraph_is_refused_clearly(
    step_index: bool, as_in_a_fresh_process: None
) -> None:
    """Its sparse attention reads each sample's text mask on the host (and, without a
    step index, the timestep): fullgraph=True is refused at the first trace, a dense
    step, naming ditops and fullgraph=False. Before: without a step index the graph
    traced at step 0 was silently reused at step 1 (dense output on a sparse step);
    with one, a data-dependent guard error from dynamo."""
    from tests.integrations.test_diffusers_hunyuan_video import inputs as hunyuan_inputs

    model, eager = _hunyuan_sparse()
    x = hunyuan_inputs(frames=8, hw=16)
    step = 0 if step_index else None
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="ditops: ") as err:
        _hunyuan_run(compiled, step=step, **x)
    assert "fullgraph=False" in _message(err.value), _message(err.value)
    assert "HunyuanVideo" in _message(err.value) or "step_index" in _message(err.value)
    later = {**x, "timestep": torch.tensor([400])}
    for m in (model, eager):
        _hunyuan_run(m, step=step, **x)
    assert torch.equal(  # the refusal changed nothing: eager as before
        _hunyuan_run(model, step=1 if step_index else None, **later),
        _hunyuan_run(eager, step=1 if step_index else None, **later),
    )
