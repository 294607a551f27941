"""The estimator's documented behaviour: invariants, selection rules, odd lengths, GQA.

The loop-based kernel of the NPU test double (written from the operator's contract, not
from ditops' code) is the oracle for the vectorised reference; inputs are small integers
so every dtype computes the same scores.
"""

from __future__ import annotations

import functools

import pytest
import torch

import ditops.attention.estimate as estimate_mod
from ditops.attention.block_mask import causal_candidates, row_counts
from ditops.attention.estimate import (
    block_scores,
    estimate_block_mask_reference,
    force_dense_blocks,
    select_blocks,
)
from ditops.attention.layout import plan_chunks
from tests.doubles.npu_sparse_attention import sparse_block_estimate as loop_oracle


def integer_qk(
    heads: int, kv_heads: int, seq: int, dim: int = 16, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """q/k with entries in {-1, 0, 1}: dot products are small integers, exact in bf16."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-1, 2, (1, heads, seq, dim), generator=gen).float()
    k = torch.randint(-1, 2, (1, kv_heads, seq, dim), generator=gen).float()
    # A bias per position makes attention uneven, so thresholds and caps matter.
    q[..., 0] = 1.0
    k[..., 0] = torch.randint(-3, 4, (1, kv_heads, seq), generator=gen).float()
    return q, k


SMALL = {"block_size": 32, "stride": 4}


def test_output_types_and_counts_are_row_sums() -> None:
    q, k = integer_qk(4, 2, 1000)
    mask, counts = estimate_block_mask_reference(q, k, keep_ratio=0.3, threshold=0.8, **SMALL)
    assert mask.dtype == torch.int8 and counts.dtype == torch.int32
    assert mask.shape == (1, 4, 32, 32) and counts.shape == (1, 4, 32)
    assert set(mask.unique().tolist()) <= {0, 1}
    assert torch.equal(counts, row_counts(mask))


@pytest.mark.parametrize("causal", [False, True])
def test_sink_and_recent_blocks_are_kept(causal: bool) -> None:
    q, k = integer_qk(2, 2, 1000)
    mask, _ = estimate_block_mask_reference(q, k, keep_ratio=0.1, causal=causal, **SMALL)
    assert bool(mask[..., 0].all())
    rows = torch.arange(32)
    last = rows if causal else torch.full((32,), 31)
    assert bool(mask[0, :, rows, last].all())
    if causal:
        assert not bool((mask[0] & ~causal_candidates(32, 32)).any())


def test_keep_cap_applies_from_ten_candidates() -> None:
    """sglang's reading: keep_ratio caps each row's scored blocks."""
    q, k = integer_qk(2, 2, 1000, seed=1)
    keep_ratio = 0.25
    mask, counts = estimate_block_mask_reference(
        q,
        k,
        keep_ratio=keep_ratio,
        causal=True,
        keep_sink=False,
        keep_recent=False,
        forced_blocks="on_top",
        **SMALL,
    )
    for r in range(32):
        candidates = r + 1
        if candidates <= 2:
            expected = candidates
        elif candidates < 10:
            expected = candidates  # no cap, threshold 1 keeps all
        else:
            expected = int(candidates * keep_ratio)
        # Ties at the cut-off are kept, so the cap is a floor plus ties; integer scores
        # tie rarely, and never enough to double a row.
        got = counts[0, :, r]
        assert bool((got >= expected).all()), (r, got, expected)
        if candidates >= 10:
            assert bool((got <= expected + 2).all()), (r, got, expected)
        else:
            assert bool((got == expected).all()), (r, got, expected)


def test_threshold_one_and_keep_ratio_one_keep_everything() -> None:
    q, k = integer_qk(2, 1, 777)
    mask, counts = estimate_block_mask_reference(q, k, threshold=1.0, keep_ratio=1.0, **SMALL)
    assert bool(mask.all()) and bool((counts == 25).all())
    mask, _ = estimate_block_mask_reference(
        q, k, threshold=1.0, keep_ratio=1.0, causal=True, **SMALL
    )
    assert torch.equal(mask[0, 0].bool(), causal_candidates(25, 25))


@pytest.mark.parametrize("forced_blocks", ["in_budget", "on_top"])
def test_first_frame_blocks_are_dense(forced_blocks: str) -> None:
    q, k = integer_qk(2, 2, 1000)
    kw = {"keep_ratio": 0.3, "forced_blocks": forced_blocks, **SMALL}
    mask, counts = estimate_block_mask_reference(q, k, dense_blocks=3, **kw)
    assert bool(mask[..., :3, :].all()) and bool(mask[..., :, :3].all())
    assert torch.equal(counts, row_counts(mask))
    sparse, _ = estimate_block_mask_reference(q, k, **kw)
    if forced_blocks == "on_top":
        assert int(mask.sum()) > int(sparse.sum())
    else:  # the same budget, spent differently
        assert int(mask.sum()) == int(sparse.sum()) and not torch.equal(mask, sparse)


def test_dense_forcing_respects_causal_and_copies() -> None:
    mask = torch.zeros(1, 1, 4, 4, dtype=torch.int8)
    out = force_dense_blocks(mask, 2, causal=True)
    assert out.tolist() == [[[[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0]]]]
    assert int(mask.sum()) == 0
    assert torch.equal(force_dense_blocks(mask, 0, causal=False), mask)


# --- the selection rules on hand-made block scores -------------------------------------


def select(row: list[float], **kw) -> list[int]:
    scores = torch.tensor([row] * len(row))  # every row the same (non-causal)
    opts = {
        "threshold": 1.0,
        "keep_ratio": 1.0,
        "keep_sink": False,
        "keep_recent": False,
        "causal": False,
    }
    opts.update(kw)
    return select_blocks(scores, **opts)[0].int().tolist()


def test_threshold_accumulates_sorted_mass() -> None:
    row = [0.05, 0.4, 0.05, 0.3, 0.2]
    assert select(row, threshold=0.5) == [0, 1, 0, 1, 0]  # 0.4 + 0.3 reaches 0.5
    assert select(row, threshold=0.4) == [0, 1, 0, 0, 0]  # 0.4 alone reaches it
    assert select(row, threshold=0.95) == [1, 1, 1, 1, 1]  # the 0.05 tie is kept


def test_sink_and_recent_take_no_part_in_the_mass() -> None:
    row = [0.9, 0.02, 0.04, 0.03, 0.01]
    # Without the sink, 0.9 alone is half of the mass; with it, the rest is scored.
    assert select(row, threshold=0.5) == [1, 0, 0, 0, 0]
    assert select(row, threshold=0.5, keep_sink=True, keep_recent=True) == [1, 0, 1, 1, 1]


def test_cap_needs_ten_candidates() -> None:
    row = [float(i + 1) for i in range(9)]
    assert sum(select(row, keep_ratio=0.2)) == 9  # 9 candidates: no cap
    row = [float(i + 1) for i in range(12)]
    kept = select(row, keep_ratio=0.2)
    assert kept == [0] * 10 + [1, 1]  # int(12 * 0.2) = 2 largest


def test_cap_replaces_a_looser_threshold_cut() -> None:
    row = [1.0] * 4 + [2.0] * 8
    kept = select(row, threshold=0.9, keep_ratio=0.5)
    assert sum(kept) == 8  # the 6th largest is a 2.0: every 2.0 tie is kept
    assert sum(select(row, threshold=0.9, keep_ratio=0.25)) == 8


def test_causal_rows_with_two_candidates_keep_both() -> None:
    scores = torch.tensor([[1.0, 0, 0], [0.99, 0.01, 0], [0.9, 0.05, 0.05]])
    keep = select_blocks(
        scores, threshold=0.5, keep_ratio=1.0, keep_sink=False, keep_recent=False, causal=True
    )
    assert keep.int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 0, 0]]


# --- lengths, layouts, heads, chunking -------------------------------------------------


@pytest.mark.parametrize("seq", [1000, 257])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "keep", [(0.3, 1.0, True, True), (0.5, 0.9, False, True), (1.0, 0.6, True, False)]
)
def test_matches_the_loop_oracle(seq: int, causal: bool, keep: tuple) -> None:
    keep_ratio, threshold, sink, recent = keep
    q, k = integer_qk(4, 2, seq, seed=seq)
    scale = 0.25
    # The double computes in fp32 from its (exactly representable) half inputs.
    mask, counts = estimate_block_mask_reference(
        q,
        k,
        scale=scale,
        threshold=threshold,
        keep_ratio=keep_ratio,
        keep_sink=sink,
        keep_recent=recent,
        causal=causal,
        forced_blocks="on_top",
        **SMALL,
    )
    want, want_counts = loop_oracle(
        q.bfloat16(),
        k.bfloat16(),
        None,
        None,
        "BNSD",
        4,
        32,
        4,
        2,
        scale / 4,
        threshold,
        causal,
        sink,
        recent,
        keep_ratio,
    )
    blocks = mask.shape[-1]
    assert want.shape[-1] % 32 == 0 and not bool(want[..., blocks:].any())
    assert torch.equal(mask, want[..., :blocks])
    assert torch.equal(counts, want_counts)


def test_padding_never_counts_as_a_key() -> None:
    # Every real logit is -36: softmax over real keys only is uniform. Zero-padded keys
    # (logit 0) would take all the mass if they counted.
    seq, dim = 1000, 16
    q = torch.ones(1, 1, seq, dim)
    k = -torch.ones(1, 1, seq, dim)
    scores = block_scores(q, k, block_size=128, stride=8, score_scale=1 / 8, causal=False)
    cols = torch.tensor([16.0] * 7 + [125 - 7 * 16])  # strided key columns per block
    rows = torch.tensor([16.0] * 7 + [125 - 7 * 16])  # strided query rows per block
    assert torch.allclose(scores[0, 0], rows[:, None] * cols[None, :] / 125, rtol=1e-5)


def test_gqa_reads_key_head_n_over_group() -> None:
    q, k = integer_qk(4, 2, 600)
    got = estimate_block_mask_reference(q, k, keep_ratio=0.4, **SMALL)
    want = estimate_block_mask_reference(q, k.repeat_interleave(2, dim=1), keep_ratio=0.4, **SMALL)
    assert torch.equal(got[0], want[0])
    swapped = estimate_block_mask_reference(q, k.flip(1), keep_ratio=0.4, **SMALL)
    assert not torch.equal(got[0], swapped[0])


def test_bsnd_layout_equals_bnsd() -> None:
    q, k = integer_qk(2, 1, 500)
    got = estimate_block_mask_reference(
        q.transpose(1, 2), k.transpose(1, 2), layout="BSND", keep_ratio=0.3, **SMALL
    )
    want = estimate_block_mask_reference(q, k, keep_ratio=0.3, **SMALL)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_chunking_does_not_change_the_result(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k = integer_qk(4, 2, 1000)
    want = block_scores(q, k, block_size=32, stride=4, score_scale=0.1, causal=True)
    small = functools.partial(plan_chunks, budget=250 * 24)  # 3 blocks of 8 rows per chunk
    monkeypatch.setattr(estimate_mod, "plan_chunks", small)
    got = block_scores(q, k, block_size=32, stride=4, score_scale=0.1, causal=True)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_block_scores_rows_hold_each_strided_rows_mass() -> None:
    q, k = integer_qk(2, 2, 1000)
    scores = block_scores(q, k, block_size=32, stride=4, score_scale=0.1, causal=False)
    rows = torch.tensor([8.0] * 31 + [250 - 31 * 8])
    assert torch.allclose(scores.sum(-1), rows.expand(1, 2, 32), rtol=1e-5)


def test_batches_are_independent() -> None:
    q, k = integer_qk(2, 1, 500, seed=3)
    q2, k2 = integer_qk(2, 1, 500, seed=4)
    mask, counts = estimate_block_mask_reference(
        torch.cat([q, q2]), torch.cat([k, k2]), keep_ratio=0.3, **SMALL
    )
    for b, (qb, kb) in enumerate([(q, k), (q2, k2)]):
        want, want_counts = estimate_block_mask_reference(qb, kb, keep_ratio=0.3, **SMALL)
        assert torch.equal(mask[b : b + 1], want) and torch.equal(counts[b : b + 1], want_counts)
