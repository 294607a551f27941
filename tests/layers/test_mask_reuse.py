"""Mask reuse across denoising steps (``BlockSparseConfig(estimate_every=N)``).

A layer estimates at a sparse step and reuses that mask for the next N - 1 steps, per
guidance branch; a step that does not move forward (a new pipeline call) or a change of
shapes estimates afresh. Calls are counted with hooks on the two op instances, so the
tests see exactly which mask each attention call received.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from ditops import config
from ditops.attention.schedule import BlockSparseConfig
from ditops.layers.sparse_attention import MAX_MASK_BRANCHES, BlockSparseAttention
from ditops.ops.block_sparse_attention import block_sparse_attention
from ditops.ops.estimate_block_mask import estimate_block_mask

SMALL = {"block_size": 32, "stride": 4}


@pytest.fixture(autouse=True)
def _native_attention() -> Iterator[None]:
    """The meaning of the attention: no FlexAttention compile per shape (seconds each)."""
    with config.override(custom_ops="-block_sparse_attention"):
        yield


def qkv(seed: int, seq: int = 320, heads: int = 2) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, heads, seq, 16, generator=gen) for _ in range(3))


@contextlib.contextmanager
def watch() -> Iterator[dict[str, list]]:
    """Records the masks the estimator returns and the masks attention receives."""
    seen: dict[str, list] = {"estimated": [], "used": []}

    def estimated(_m, _args, _kwargs, out) -> None:
        seen["estimated"].append(out[0])

    def used(_m, args, _kwargs) -> None:
        seen["used"].append(args[3])

    handles = [
        estimate_block_mask.op.register_forward_hook(estimated, with_kwargs=True),
        block_sparse_attention.op.register_forward_pre_hook(used, with_kwargs=True),
    ]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def run(layer: BlockSparseAttention, calls: list[tuple[int | None, str | None, int]]):
    """Each call: (step, branch, input seed); returns, per call, whether it estimated and
    the mask its attention used."""
    out = []
    with watch() as seen, torch.inference_mode():
        for step, branch, seed in calls:
            before = len(seen["estimated"])
            q, k, v = qkv(seed)
            layer(q, k, v, step=step, branch=branch)
            out.append((len(seen["estimated"]) > before, seen["used"][-1]))
    return out


def test_masks_are_reused_exactly_n_minus_1_times_per_branch() -> None:
    layer = BlockSparseAttention(sparsity=0.5, skip_first_steps=1, estimate_every=3, **SMALL)
    calls = []
    for step in range(1, 9):  # step 0 is dense; inputs differ per step and branch
        calls += [(step, "cond", 2 * step), (step, "uncond", 2 * step + 1)]
    got = run(layer, calls)
    for branch in (0, 1):
        mine = got[branch::2]
        assert [e for e, _ in mine] == [True, False, False] * 2 + [True, False]
        for anchor in (0, 3, 6):
            group = [m for _, m in mine[anchor : anchor + 3]]
            assert all(m is group[0] for m in group)  # the same int8 tensor, reused
            assert group[0].dtype == torch.int8
    # The branches keep their own masks (different inputs, different masks).
    assert got[0][1] is not got[1][1] and not torch.equal(got[0][1], got[1][1])
    assert len(layer._thread_masks()) == 2


def test_a_reused_mask_gives_what_attention_with_it_gives() -> None:
    layer = BlockSparseAttention(sparsity=0.5, estimate_every=2, **SMALL)
    with torch.inference_mode():
        q1, k1, v1 = qkv(1)
        layer(q1, k1, v1, step=0, branch="cond")
        method = layer.config.method
        mask, counts = estimate_block_mask(q1, k1, keep_ratio=0.5, method=method, **SMALL)
        q2, k2, v2 = qkv(2)
        out = layer(q2, k2, v2, step=1, branch="cond")
        want = block_sparse_attention(q2, k2, v2, mask, counts, block_size=32)
        fresh, _ = estimate_block_mask(q2, k2, keep_ratio=0.5, method=method, **SMALL)
    assert torch.equal(out, want)
    assert not torch.equal(fresh, mask)  # a per-step estimate would have differed


def test_a_new_pipeline_call_estimates_afresh() -> None:
    layer = BlockSparseAttention(sparsity=0.5, skip_first_steps=1, estimate_every=4, **SMALL)
    first = [(s, "cond", s) for s in range(1, 4)]
    # The next call starts again (step index back to 1), then a call whose only sparse
    # step repeats the last one (the same index is a new call too).
    second = [(s, "cond", 10 + s) for s in range(1, 3)] + [(2, "cond", 20)]
    got = run(layer, first + second)
    assert [e for e, _ in got] == [True, False, False, True, False, True]


def test_shape_changes_estimate_afresh() -> None:
    layer = BlockSparseAttention(sparsity=0.5, estimate_every=4, **SMALL)
    with watch() as seen, torch.inference_mode():
        for step, seq in ((0, 320), (1, 320), (2, 352), (3, 352)):
            q, k, v = qkv(step, seq=seq)
            layer(q, k, v, step=step, branch="cond")
        layer.set_video_shape((1, 16, 5, 16, 16), (1, 2, 2))  # first-frame blocks: 2
        layer(q, k, v, step=4, branch="cond")
        layer.clear_masks()
        layer(q, k, v, step=5, branch="cond")
    assert len(seen["estimated"]) == 4  # steps 0, 2 (new length), 4 (first frame), 5


def test_no_step_means_no_reuse() -> None:
    layer = BlockSparseAttention(sparsity=0.5, estimate_every=3, **SMALL)
    got = run(layer, [(None, "cond", 1), (None, "cond", 1), (None, None, 2)])
    assert [e for e, _ in got] == [True, True, True]
    assert not layer._masks


def test_every_step_keeps_nothing() -> None:
    layer = BlockSparseAttention(sparsity=0.5, **SMALL)
    got = run(layer, [(0, "cond", 1), (1, "cond", 1)])
    assert [e for e, _ in got] == [True, True] and not layer._masks


def test_memory_is_one_mask_per_branch_and_bounded() -> None:
    layer = BlockSparseAttention(sparsity=0.5, estimate_every=2, **SMALL)
    names = [f"b{i}" for i in range(MAX_MASK_BRANCHES + 2)]
    run(layer, [(s, name, s) for s in (0, 1) for name in names])
    assert list(layer._thread_masks()) == names[-MAX_MASK_BRANCHES:]
    for entry in layer._thread_masks().values():
        assert entry.mask.dtype == torch.int8 and entry.mask.shape == (1, 2, 10, 10)


def test_config_validates_the_interval() -> None:
    with pytest.raises(ValueError, match="estimate_every must be >= 1, got 0"):
        BlockSparseAttention(sparsity=0.5, estimate_every=0)
    assert BlockSparseConfig(sparsity=0.5, estimate_every=5).estimate_every == 5


def test_reuse_under_torch_compile_matches_eager_without_a_graph_per_step() -> None:
    """Compiled first (no eager call before): the bookkeeping runs eagerly, so each call
    gets eager's mask (the same outputs, bit for bit) and the step index does not make a
    graph per step. (No hooks here: dynamo would guard on the lists they fill.)"""
    import torch._dynamo

    calls = [(s, b, 10 * s + (b == "uncond")) for s in range(1, 7) for b in ("cond", "uncond")]
    with torch.inference_mode():
        layer = BlockSparseAttention(sparsity=0.5, estimate_every=3, **SMALL)
        eager = [layer(*qkv(seed), step=step, branch=b) for step, b, seed in calls]
        torch._dynamo.reset()
        layer = BlockSparseAttention(sparsity=0.5, estimate_every=3, **SMALL)
        frames: list[int] = []

        def backend(gm: torch.fx.GraphModule, _inputs: list) -> object:
            frames.append(1)
            return gm.forward

        compiled = torch.compile(layer, backend=backend)
        graphs_by_step = []
        for (step, branch, seed), want in zip(calls, eager):
            assert torch.equal(compiled(*qkv(seed), step=step, branch=branch), want), step
            graphs_by_step.append(len(frames))
    # reuse at steps 2-3 and 5-6 used the kept masks: a fresh estimate would differ
    fresh = BlockSparseAttention(sparsity=0.5, **SMALL)
    with torch.inference_mode():
        assert not torch.equal(fresh(*qkv(20), step=2), eager[2])
    # every graph is made in the first steps (an estimate, a reuse): later steps add none
    assert graphs_by_step[5] == graphs_by_step[-1] > 0, graphs_by_step
