"""The estimator's methods: sampled scores, per-head allocation, validation, dispatch."""

from __future__ import annotations

import pytest
import torch

from ditops import config
from ditops.attention import methods
from ditops.attention.estimate import estimate_block_mask_reference
from ditops.attention.methods import (
    METHODS,
    sample_rows,
    sampled_block_scores,
    sampled_block_scores_fp32,
)
from ditops.attention.schedule import BlockSparseConfig
from ditops.attention.selection import block_budget, forced_block_mask
from ditops.bench.video_attention import exact_block_mass, video_attention
from ditops.custom_op import reset_state
from ditops.ops.attention_npu import estimate_reasons
from ditops.ops.estimate_block_mask import estimate_block_mask, triton_estimate_reasons

SMALL = {"block_size": 32, "stride": 4}
FLAGS = {"keep_sink": True, "keep_recent": True, "causal": False}


def qk(heads: int = 4, seq: int = 320, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, _ = video_attention(4, 8, 10, heads=heads, dim=24, seed=seed)
    return q[:, :, :seq], k[:, :, :seq]


def test_every_row_sampled_is_the_exact_block_mass() -> None:
    q, k = qk()
    scores = sampled_block_scores(q, k, block_size=32, samples=32, scale=24**-0.5, causal=False)
    torch.testing.assert_close(scores, exact_block_mass(q, k, block_size=32))


def test_sampled_rows_spread_over_each_block_and_stay_inside_it() -> None:
    rows = sample_rows(70, 32, 4).view(3, 4)
    assert rows[0].tolist() == [4, 12, 20, 28] and rows[1].tolist() == [36, 44, 52, 60]
    assert rows[2].tolist() == [64, 66, 67, 69]  # the partial last block: 6 rows
    scores = sampled_block_scores(*qk(seq=70), block_size=32, samples=4, scale=0.2, causal=False)
    torch.testing.assert_close(scores.sum(-1), torch.full((1, 4, 3), 4.0))


def test_gqa_and_causal_sampled_scores() -> None:
    q, k = qk(heads=4)
    k2 = k[:, ::2]  # 2 key heads: query head n reads key head n // 2
    opts = {"block_size": 32, "samples": 3, "scale": 0.3}
    got = sampled_block_scores(q, k2, causal=True, **opts)
    want = sampled_block_scores(q, k2.repeat_interleave(2, dim=1), causal=True, **opts)
    torch.testing.assert_close(got, want)
    above = torch.ones(10, 10, dtype=torch.bool).triu(1)
    assert float(got[..., above].abs().max()) == 0.0


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("keep", [0.5, 0.7])
def test_every_method_runs_the_density_asked_for(method: str, keep: float) -> None:
    q, k = qk()
    mask, counts = estimate_block_mask_reference(
        q, k, keep_ratio=keep, dense_blocks=2, method=method, samples=2, **SMALL
    )
    budget = block_budget(10, 10, keep_ratio=keep, dense_blocks=2, **FLAGS)
    if METHODS[method][1] == "layer":  # the layer's budget: heads may differ
        assert int(mask.sum()) == 4 * budget.total
    else:
        assert mask.sum(dim=(-1, -2)).tolist() == [[budget.total] * 4]
    assert bool(mask.bool()[..., forced_block_mask(10, 10, dense_blocks=2, **FLAGS)].all())
    assert torch.equal(counts, mask.sum(-1, dtype=torch.int32))


def test_per_head_allocation_gives_diffuse_rows_more_blocks() -> None:
    from ditops.attention.estimate import mask_from_scores

    scores = torch.zeros(1, 1, 4, 8)
    scores[..., 0, :] = 1.0  # diffuse: mass spread over every block
    scores[..., 1:, 3] = 1.0  # sharp: one block holds it all
    opts = {
        "threshold": 1.0,
        "keep_ratio": 0.5,
        "keep_sink": False,
        "keep_recent": False,
        "causal": False,
        "dense_blocks": 0,
    }
    row, _ = mask_from_scores(scores, allocation="row", **opts)
    head, _ = mask_from_scores(scores, allocation="head", **opts)
    assert row.sum(-1).tolist() == [[[4, 4, 4, 4]]]
    # The same 16 blocks: the diffuse row takes all 8, each sharp row its one block
    # (the 5 left over hold nothing and go to the earliest rows).
    assert int(head.sum()) == 16 and int(head[0, 0, 0].sum()) == 8
    assert bool(head[0, 0, 1:, 3].all())


def test_per_layer_allocation_gives_diffuse_heads_more_blocks() -> None:
    from ditops.attention.estimate import mask_from_scores

    scores = torch.zeros(1, 2, 4, 8)
    scores[:, 0] = 1.0  # head 0 diffuse: every row spreads its mass over all 8 blocks
    scores[:, 1, :, 2] = 1.0  # head 1 sharp: each row's mass in one block
    opts = {
        "threshold": 1.0,
        "keep_ratio": 0.25,
        "keep_sink": False,
        "keep_recent": False,
        "causal": False,
        "dense_blocks": 0,
    }
    head, _ = mask_from_scores(scores, allocation="head", **opts)
    layer, _ = mask_from_scores(scores, allocation="layer", **opts)
    assert head.sum(dim=(-1, -2)).tolist() == [[8, 8]]
    # The same 16 blocks: the sharp head needs its 4 (one per row), the diffuse one
    # takes the other 12.
    assert layer.sum(dim=(-1, -2)).tolist() == [[12, 4]]
    assert bool(layer[0, 1, :, 2].all())
    kept = lambda m: float((scores / scores.sum(-1, keepdim=True) * m).sum())  # noqa: E731
    assert kept(layer) > kept(head)


def test_per_layer_allocation_keeps_forced_blocks_and_the_budget_on_video_attention() -> None:
    q, k = qk(heads=4)
    opts = {"keep_ratio": 0.4, "dense_blocks": 2, "samples": 2, **SMALL}
    mask, counts = estimate_block_mask_reference(q, k, method="sampled_layer", **opts)
    head_mask, _ = estimate_block_mask_reference(q, k, method="sampled_head", **opts)
    assert int(mask.sum()) == int(head_mask.sum())
    assert bool(mask.bool()[..., forced_block_mask(10, 10, dense_blocks=2, **FLAGS)].all())
    assert torch.equal(counts, mask.sum(-1, dtype=torch.int32))
    mass = exact_block_mass(q, k, block_size=32)
    assert float((mass * mask).sum()) >= float((mass * head_mask).sum())


def test_the_sampled_estimate_beats_the_antidiagonal_on_video_attention() -> None:
    # The claim the default rests on, at a small size: mass kept at density 0.25.
    q, k, _ = video_attention(6, 8, 16, heads=4, dim=40, seed=3)  # 768 tokens, 12 blocks
    mass = exact_block_mass(q, k, block_size=64)
    kept = {}
    for method in ("sampled", "antidiagonal"):
        mask, _ = estimate_block_mask_reference(
            q, k, block_size=64, stride=8, keep_ratio=0.25, method=method
        )
        kept[method] = float((mass * mask).sum() / mass.sum())
    assert kept["sampled"] > kept["antidiagonal"]


def test_bad_methods_are_refused_saying_what_is_valid() -> None:
    with pytest.raises(ValueError, match=r"method must be one of \('sampled'"):
        BlockSparseConfig(sparsity=0.5, method="kmeans")
    with pytest.raises(ValueError, match="samples must be an int >= 1"):
        BlockSparseConfig(sparsity=0.5, samples=0)
    with pytest.raises(ValueError, match="needs forced_blocks='in_budget'"):
        BlockSparseConfig(sparsity=0.5, method="sampled_head", forced_blocks="on_top")
    with pytest.raises(ValueError, match="threshold < 1"):
        BlockSparseConfig(sparsity=0.5, method="antidiagonal_head", threshold=0.9)
    with pytest.raises(ValueError, match="over a layer's heads; it needs forced_blocks"):
        BlockSparseConfig(sparsity=0.5, method="sampled_layer", forced_blocks="on_top")
    q, k = qk()
    with pytest.raises(ValueError, match="method must be one of"):
        estimate_block_mask(q, k, keep_ratio=0.5, method="best", **SMALL)
    assert BlockSparseConfig().method == "sampled"


@pytest.mark.parametrize("kind", ["cuda", "npu"])
def test_kernels_that_cannot_score_sampled_rows_say_so(kind: str) -> None:
    q, k = qk()
    path_reasons = estimate_reasons if kind == "npu" else triton_estimate_reasons
    reasons = path_reasons(estimate_block_mask.op.prepare(q, k, method="sampled", **SMALL))
    assert any("antidiagonal scores only" in r for r in reasons)
    if kind == "npu":
        reasons = path_reasons(
            estimate_block_mask.op.prepare(q, k, method="antidiagonal_head", **SMALL)
        )
        assert any("budget per row only" in r for r in reasons)


def test_cpu_path_serves_the_sampled_method(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    reset_state()
    q, k = (t.bfloat16() for t in qk())
    opts = {"keep_ratio": 0.3, "dense_blocks": 1, "method": "sampled", **SMALL}
    try:
        with torch.inference_mode(), config.override(strict=True):
            assert estimate_block_mask.op.explain_call(q, k, **opts).chosen == "forward_cpu"
            mask, _ = estimate_block_mask(q, k, **opts)
        want, _ = estimate_block_mask_reference(q.float(), k.float(), **opts)
    finally:
        reset_state()
    assert torch.equal(mask, want)  # fp32 copies: the meaning on fp32 inputs


def test_nan_scores_are_never_kept() -> None:
    q, k = qk()
    q[0, 1, int(sample_rows(320, 32, 2)[6])] = float("nan")  # a sampled row of block 3
    mask, _ = estimate_block_mask_reference(
        q, k, keep_ratio=0.4, dense_blocks=1, method="sampled", samples=2, **SMALL
    )
    forced = forced_block_mask(10, 10, dense_blocks=1, **FLAGS)
    assert torch.equal(mask[0, 1, 3].bool(), forced[3])
    assert not torch.equal(mask[0, 0, 3].bool(), forced[3])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp32_sampled_scores_are_the_sampled_scores_in_fp32(monkeypatch, dtype, causal) -> None:
    q, k = qk(heads=4, seq=300)  # a partial last block of 12 keys
    q, k2 = q.to(dtype), k[:, ::2].to(dtype)  # GQA: 2 key heads
    opts = {"block_size": 32, "samples": 3, "scale": 0.3, "causal": causal}
    want = sampled_block_scores(q.double(), k2.double(), **opts).float()
    torch.testing.assert_close(sampled_block_scores_fp32(q, k2, **opts), want)
    monkeypatch.setattr(methods, "FP32_CHUNK_ELEMENTS", 1000)  # chunks of heads and rows
    torch.testing.assert_close(sampled_block_scores_fp32(q, k2, **opts), want)
    if not causal:  # every row of whole blocks sampled: the exact block mass
        q, k = qk(heads=4, seq=320)
        full = sampled_block_scores_fp32(q, k, **{**opts, "samples": 32, "scale": 24**-0.5})
        torch.testing.assert_close(full, exact_block_mass(q, k, block_size=32))
