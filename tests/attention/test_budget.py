"""The density asked for is the density that runs (``forced_blocks="in_budget"``).

Forced blocks (first frame, sink, recent) are paid from the budget; the rest of it is
split over the rows; when the forced blocks alone exceed it, they alone run and ditops
warns once, naming the smallest reachable density. sglang's reading (``"on_top"``)
stays reachable. Shapes are Wan's after 2x2 patching: 21 latent frames of 16 x 24 tokens
(63 blocks of 128, the first frame 3 blocks) and 480p, 21 frames of 30 x 52 (256
blocks, 13 for the first frame); a small head dim keeps the estimate cheap.
"""

from __future__ import annotations

import logging

import pytest
import torch

import ditops.attention.estimate as estimate_mod
import ditops.attention.selection as selection_mod
from ditops.attention.block_mask import causal_candidates, density_stats, row_counts
from ditops.attention.estimate import (
    block_scores,
    estimate_block_mask_reference,
    force_dense_blocks,
    mask_from_scores,
    select_blocks,
)
from ditops.attention.schedule import first_frame_dense_blocks
from ditops.attention.selection import block_budget, forced_block_mask, select_in_budget
from ditops.layers.sparse_attention import BlockSparseAttention
from ditops.ops.block_sparse_attention import block_sparse_attention
from ditops.ops.estimate_block_mask import estimate_block_mask

WAN_SMALL = (1, 16, 21, 32, 48)  # 8064 tokens
WAN_480P = (1, 16, 21, 60, 104)  # 32760 tokens


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(selection_mod, "_WARNED_FORCED_ONLY", set())


def wan_like_qk(latent: tuple[int, ...], heads: int = 2, dim: int = 8, seed: int = 0):
    """q/k of a video's tokens (frames x h/2 x w/2) with local, frame-aware structure."""
    frames, h, w = latent[2], latent[3] // 2, latent[4] // 2
    t, y, x = torch.meshgrid(torch.arange(frames), torch.arange(h), torch.arange(w), indexing="ij")
    pos = torch.stack([t, y, x], -1).reshape(-1, 3).float()
    gen = torch.Generator().manual_seed(seed)
    freqs = torch.randn(heads, 3, dim // 2, generator=gen) * 0.3
    phase = torch.einsum("sc,hcf->hsf", pos, freqs)
    base = torch.cat([phase.sin(), phase.cos()], -1)
    q = base + 0.3 * torch.randn(base.shape, generator=gen)
    k = base + 0.3 * torch.randn(base.shape, generator=gen)
    # fp32: the density does not depend on the dtype, and CPUs without AVX-512 run bf16
    # matmuls very slowly.
    return q[None] * 2, k[None] * 2


def block_density(mask: torch.Tensor, causal: bool = False) -> float:
    q_blocks, kv_blocks = mask.shape[-2:]
    cells = int(causal_candidates(q_blocks, kv_blocks).sum()) if causal else q_blocks * kv_blocks
    return float(mask.float().sum() / (cells * mask.shape[0] * mask.shape[1]))


# --- the budget's arithmetic -------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dense_blocks", [0, 1, 3, 13])
@pytest.mark.parametrize(("sink", "recent"), [(True, True), (False, True), (True, False)])
def test_forced_counts_match_the_forced_mask(causal, dense_blocks, sink, recent) -> None:
    for q_blocks, kv_blocks in ((63, 63), (20, 20), (7, 12), (12, 7)):
        flags = {"keep_sink": sink, "keep_recent": recent, "causal": causal}
        forced = forced_block_mask(q_blocks, kv_blocks, dense_blocks=dense_blocks, **flags)
        for ratio in (0.2, 0.5, 0.9):
            budget = block_budget(
                q_blocks, kv_blocks, keep_ratio=ratio, dense_blocks=dense_blocks, **flags
            )
            assert budget.forced == int(forced.sum())
            cand = causal_candidates(q_blocks, kv_blocks) if causal else torch.ones_like(forced)
            assert budget.candidates == int(cand.sum())
            assert not bool((forced & ~cand).any())
            if not budget.forced_only:
                assert sum(budget.per_row) == budget.total - budget.forced
                scorable = (cand & ~forced).sum(-1).tolist()
                assert all(0 <= k <= s for k, s in zip(budget.per_row, scorable))
            else:
                assert budget.per_row == (0,) * q_blocks


def test_the_split_follows_the_scored_candidates() -> None:
    # 10 x 10, first frame 2: rows 0-1 forced whole; rows 2-9 force columns 0, 1 and 9.
    budget = block_budget(
        10, 10, keep_ratio=0.5, dense_blocks=2, keep_sink=True, keep_recent=True, causal=False
    )
    assert (budget.candidates, budget.forced, budget.total) == (100, 20 + 8 * 3, 50)
    # 6 blocks over 8 equal rows: the first six rows get one each.
    assert budget.per_row == (0, 0, 1, 1, 1, 1, 1, 1, 0, 0)
    # Causal: longer rows get more.
    causal = block_budget(
        12, 12, keep_ratio=0.5, dense_blocks=0, keep_sink=True, keep_recent=True, causal=True
    )
    assert list(causal.per_row) == sorted(causal.per_row)
    assert causal.per_row[:3] == (0, 0, 0)  # rows of at most two candidates are forced


def test_rows_keep_exactly_their_share_by_rank() -> None:
    scores = torch.rand(2, 3, 10, 10, generator=torch.Generator().manual_seed(0))
    scores[0, 0, 4] = 0.5  # a row of ties: the lower key blocks win
    kw = {"keep_sink": True, "keep_recent": True, "causal": False, "dense_blocks": 2}
    keep = select_in_budget(scores, threshold=1.0, keep_ratio=0.5, **kw)
    budget = block_budget(10, 10, keep_ratio=0.5, **kw)
    forced = forced_block_mask(10, 10, **kw)
    extra = (keep & ~forced).sum(-1)
    assert extra.tolist() == [[list(budget.per_row)] * 3] * 2
    assert keep[0, 0, 4].int().tolist() == [1, 1, 1, 0, 0, 0, 0, 0, 0, 1]
    # Each row's extra blocks are its best scored ones.
    for b, h, r in ((1, 2, 5), (0, 1, 3)):
        row = scores[b, h, r].masked_fill(forced[r], -1)
        best = set(row.topk(budget.per_row[r]).indices.tolist())
        assert set((keep[b, h, r] & ~forced[r]).nonzero().flatten().tolist()) == best


def test_threshold_can_only_keep_fewer() -> None:
    row = torch.tensor([0.0, 0.5, 0.3, 0.1, 0.05, 0.05, 0.0, 0.0, 0.0, 0.0] * 1)
    scores = row.expand(10, 10).clone()
    kw = {"keep_sink": False, "keep_recent": False, "causal": False, "dense_blocks": 0}
    full = select_in_budget(scores, threshold=1.0, keep_ratio=0.3, **kw)
    assert full[0].int().tolist() == [0, 1, 1, 1, 0, 0, 0, 0, 0, 0]  # the best 3 per row
    cut = select_in_budget(scores, threshold=0.75, keep_ratio=0.3, **kw)
    assert cut[0].int().tolist() == [0, 1, 1, 0, 0, 0, 0, 0, 0, 0]  # 0.5 + 0.3 reach 0.75


def test_nan_scores_are_never_kept() -> None:
    scores = torch.rand(1, 1, 12, 12, generator=torch.Generator().manual_seed(1))
    scores[0, 0, 5] = float("nan")
    kw = {"keep_sink": True, "keep_recent": True, "causal": False, "dense_blocks": 0}
    keep = select_in_budget(scores, threshold=1.0, keep_ratio=0.5, **kw)
    assert keep[0, 0, 5].nonzero().flatten().tolist() == [0, 11]


# --- asked vs realised on Wan's shapes ----------------------------------------------------


@pytest.mark.parametrize("sparsity", [0.5, 0.75])
def test_realised_density_is_the_one_asked_for_at_every_step(sparsity: float) -> None:
    """21 latent frames: through the layer, at every sparse step, with changing inputs."""
    layer = BlockSparseAttention(sparsity=sparsity, skip_first_steps=1)
    layer.set_video_shape(WAN_SMALL, (1, 2, 2))
    assert layer.dense_blocks == 3
    seen: list[float] = []

    def record(_module, args, _kwargs) -> None:
        seen.append(block_density(args[3]))

    handle = block_sparse_attention.op.register_forward_pre_hook(record, with_kwargs=True)
    try:
        for step in range(1, 4):
            q, k = wan_like_qk(WAN_SMALL, seed=step)
            with torch.inference_mode(), pytest.MonkeyPatch.context() as mp:
                # Only the mask matters here: skip the attention's work.
                mp.setattr(block_sparse_attention.op, "run", lambda call, *a, **kw: call.q)
                layer(q, k, k, step=step)
    finally:
        handle.remove()
    assert len(seen) == 3
    for density in seen:
        assert abs(density - (1 - sparsity)) <= 1 / 63**2  # one block of the map


def test_on_top_runs_denser_than_asked() -> None:
    """sglang's reading on the same inputs: the first frame comes on top of the budget."""
    q, k = wan_like_qk(WAN_SMALL)
    kw = {"keep_ratio": 0.25, "dense_blocks": 3}
    mask, _ = estimate_block_mask_reference(q, k, **kw)
    top, _ = estimate_block_mask_reference(q, k, forced_blocks="on_top", **kw)
    assert abs(block_density(mask) - 0.25) <= 1e-3
    assert block_density(top) > 0.3


def test_on_top_is_the_cap_then_the_first_frame() -> None:
    q, k = wan_like_qk(WAN_SMALL, heads=1)
    scores = block_scores(q, k, block_size=128, stride=8, score_scale=8**-0.5 / 8, causal=False)
    flags = {"keep_sink": True, "keep_recent": True, "causal": False}
    want = force_dense_blocks(
        select_blocks(scores, threshold=1.0, keep_ratio=0.25, **flags), 3, causal=False
    )
    got, counts = estimate_block_mask_reference(
        q, k, keep_ratio=0.25, dense_blocks=3, forced_blocks="on_top"
    )
    assert torch.equal(got, want) and torch.equal(counts, row_counts(want))


def test_480p_density() -> None:
    q, k = wan_like_qk(WAN_480P, heads=1, dim=4)
    dense = first_frame_dense_blocks(WAN_480P, (1, 2, 2))
    assert dense == 13
    with torch.inference_mode():
        mask, counts = estimate_block_mask(q, k, keep_ratio=0.25, dense_blocks=dense)
        scores = block_scores(q, k, block_size=128, stride=8, score_scale=0.5 / 8, causal=False)
    assert torch.equal(counts, row_counts(mask))
    selection = {"threshold": 1.0, "keep_sink": True, "keep_recent": True, "causal": False}
    for sparsity in (0.75, 0.5, 0.85):  # 0.75 first: the op's mask
        if sparsity != 0.75:
            mask, _ = mask_from_scores(
                scores, keep_ratio=1 - sparsity, dense_blocks=dense, **selection
            )
        stats = density_stats(mask, q_len=32760, kv_len=32760, block_size=128)
        assert abs(stats.block_density - (1 - sparsity)) <= 1 / 256**2
        assert abs(stats.density - (1 - sparsity)) <= 0.05  # in tokens too (a partial block)


# --- forced blocks beyond the budget ------------------------------------------------------


def test_forced_blocks_beyond_the_budget_run_alone_and_warn_once(caplog) -> None:
    q, k = wan_like_qk(WAN_SMALL)
    with caplog.at_level(logging.WARNING, logger="ditops"), torch.inference_mode():
        mask, counts = estimate_block_mask(q, k, keep_ratio=0.1, dense_blocks=3)
        again, _ = estimate_block_mask(q, k, keep_ratio=0.1, dense_blocks=3)
    forced = forced_block_mask(
        63, 63, dense_blocks=3, keep_sink=True, keep_recent=True, causal=False
    )
    assert torch.equal(mask, forced.to(torch.int8).expand(1, 2, 63, 63))
    assert torch.equal(again, mask) and torch.equal(counts, row_counts(mask))
    (record,) = [r for r in caplog.records if r.name == "ditops"]
    message = record.getMessage()
    assert "density 0.108 ran" in message and "the smallest reachable" in message
    assert "0.100 = 1 - sparsity" in message and "forced blocks only" in message


def test_forced_blocks_alone_need_no_scores(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k = wan_like_qk(WAN_SMALL, heads=1)

    def fail(*_a, **_k):
        raise AssertionError("block scores computed for a forced-only mask")

    monkeypatch.setattr(estimate_mod, "block_scores", fail)
    with torch.inference_mode():
        estimate_block_mask(q, k, keep_ratio=0.05, dense_blocks=3)
        full, _ = estimate_block_mask(q, k, keep_ratio=1.0)  # everything: no scores either
    assert bool(full.all())


def test_budget_exactly_the_forced_blocks_is_quiet(caplog) -> None:
    budget = block_budget(
        63, 63, keep_ratio=429 / 3969, dense_blocks=3, keep_sink=True, keep_recent=True,
        causal=False,
    )  # fmt: skip
    assert budget.forced_only and budget.forced == budget.total == 429
    q, k = wan_like_qk(WAN_SMALL, heads=1)
    with caplog.at_level(logging.WARNING, logger="ditops"), torch.inference_mode():
        estimate_block_mask(q, k, keep_ratio=429 / 3969, dense_blocks=3)
    assert not [r for r in caplog.records if r.name == "ditops"]


# --- the budget under torch.compile with dynamic shapes (issue 25, item 7) -----------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    ("dense_blocks", "sink", "recent"), [(0, True, True), (0, False, False), (3, True, False)]
)
def test_row_shares_are_the_host_split(causal, dense_blocks, sink, recent) -> None:
    """:meth:`BlockBudget.row_shares` (tensor ops, what the selection uses) and
    :attr:`BlockBudget.per_row` (host ints, the NPU ratio) are one split."""
    flags = {"keep_sink": sink, "keep_recent": recent, "causal": causal}
    for q_blocks, kv_blocks in ((1, 1), (2, 5), (9, 9), (13, 7), (7, 13), (40, 40)):
        for ratio in (0.1, 0.37, 0.5, 0.9, 1.0):
            budget = block_budget(
                q_blocks, kv_blocks, keep_ratio=ratio, dense_blocks=dense_blocks, **flags
            )
            assert budget.row_shares().tolist() == list(budget.per_row)


@pytest.mark.parametrize("causal", [False, True])
def test_the_selection_compiles_fullgraph_at_dynamic_shapes(causal: bool) -> None:
    """Under dynamic shapes the block counts are SymInts: the budget is closed forms and
    tensor ops (before: ``sorted`` with SymInt keys, "sort with non-constant keys")."""
    torch._dynamo.reset()
    kw = {"keep_sink": True, "keep_recent": True, "causal": causal, "dense_blocks": 2}

    def select(scores: torch.Tensor) -> torch.Tensor:
        return select_in_budget(scores, threshold=1.0, keep_ratio=0.5, **kw)

    compiled = torch.compile(select, fullgraph=True, dynamic=True, backend="aot_eager")
    gen = torch.Generator().manual_seed(0)
    for blocks in (12, 17, 23):
        scores = torch.rand(1, 2, blocks, blocks, generator=gen)
        assert not block_budget(blocks, blocks, keep_ratio=0.5, **kw).forced_only
        assert torch.equal(compiled(scores), select(scores)), blocks
