"""A mass target: keep blocks until a share of each row's (or head's) attention mass is
covered, instead of a density; the density that results is the density that runs."""

from __future__ import annotations

import math

import pytest
import torch

from ditops.attention.block_mask import density_stats
from ditops.attention.estimate import mask_from_scores
from ditops.attention.methods import sampled_block_scores
from ditops.attention.schedule import BlockSparseConfig
from ditops.attention.selection import BlockSelection, forced_block_mask
from ditops.layers.sparse_attention import BlockSparseAttention
from ditops.ops.block_sparse_attention import block_sparse_attention
from ditops.ops.estimate_block_mask import estimate_block_mask
from tests.attention.test_budget import wan_like_qk

LATENT = (1, 16, 9, 16, 24)  # 864 tokens: 14 blocks of 64


def _qk(heads: int = 3):
    q, k = wan_like_qk(LATENT, heads=heads, dim=16)
    # Heads of different sharpness: the mass target gives each the blocks it needs.
    sharp = torch.tensor([0.5, 1.5, 3.0][:heads])[None, :, None, None]
    return q * sharp, k


def _coverage(scores: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Per row: the share of the row's score mass the kept blocks hold (fp64)."""
    s = scores.double().nan_to_num(0.0)
    return (s * keep.double()).sum(-1) / s.sum(-1)


@pytest.mark.parametrize("target", [0.5, 0.8, 0.95, 0.99])
@pytest.mark.parametrize("method", ["sampled", "antidiagonal"])
def test_every_row_covers_the_target_on_the_estimates_own_scores(target, method) -> None:
    q, k = _qk()
    sel = BlockSelection(mass=target, dense_blocks=2, method=method)
    if method == "sampled":
        scores = sampled_block_scores(q, k, block_size=64, samples=4, scale=16**-0.5, causal=False)
    else:
        from ditops.attention.estimate import block_scores

        scores = block_scores(q, k, block_size=64, stride=8, score_scale=16**-0.5 / 8, causal=False)
    mask, counts = mask_from_scores(scores, sel)
    cov = _coverage(scores, mask.bool())
    assert bool((cov >= target - 1e-9).all()), float(cov.min())
    # Minimal: dropping the smallest kept scored block of any row falls below the target.
    forced = forced_block_mask(*scores.shape[-2:], sel)
    scored_kept = mask.bool() & ~forced
    s = scores.double().masked_fill(~scored_kept, math.inf)
    smallest = s.min(-1).values
    has = scored_kept.any(-1)
    without = cov - torch.where(has, smallest, 0) / scores.double().sum(-1)
    assert bool((without[has] < target).all())
    # The op gives the same mask.
    m2, c2 = estimate_block_mask(q, k, block_size=64, mass=target, dense_blocks=2, method=method)
    assert torch.equal(m2, mask) and torch.equal(c2, counts)


def test_per_head_allocation_covers_the_heads_mean() -> None:
    q, k = _qk()
    scores = sampled_block_scores(q, k, block_size=64, samples=4, scale=16**-0.5, causal=False)
    sel = BlockSelection(mass=0.9, method="sampled_head", dense_blocks=1)
    mask, _ = mask_from_scores(scores, sel)
    per_head = _coverage(scores, mask.bool()).mean(-1)
    assert bool((per_head >= 0.9 - 1e-9).all())
    # Some row may fall below: the head's mean is the target.
    row_sel = BlockSelection(mass=0.9, method="sampled", dense_blocks=1)
    row_mask, _ = mask_from_scores(scores, row_sel)
    assert int(mask.sum()) <= int(row_mask.sum())


def test_sharper_heads_get_fewer_blocks() -> None:
    q, k = _qk()
    mask, counts = estimate_block_mask(q, k, block_size=64, mass=0.9, method="sampled")
    per_head = counts.float().mean((0, 2))
    assert per_head[0] > per_head[1] > per_head[2]


def test_the_density_reported_is_the_density_run(monkeypatch) -> None:
    q, k = _qk()
    v = torch.randn_like(q)
    layer = BlockSparseAttention(mass=0.9, block_size=64, stride=8)
    seen = {}
    import ditops.layers.sparse_attention as mod

    real = mod.block_sparse_attention

    def spy(q, k, v, mask, counts, **kw):
        seen["mask"] = mask.clone()
        return real(q, k, v, mask, counts, **kw)

    monkeypatch.setattr(mod, "block_sparse_attention", spy)
    out = layer(q, k, v)
    run = density_stats(seen["mask"], q_len=q.shape[2], kv_len=k.shape[2], block_size=64)
    reported = layer.last_density()
    assert reported is not None
    assert reported.density == pytest.approx(run.density, abs=0)
    assert reported.per_head == run.per_head
    assert 0 < run.block_density < 1
    ref = block_sparse_attention(
        q, k, v, seen["mask"], seen["mask"].sum(-1, dtype=torch.int32), block_size=64
    )
    assert torch.equal(out, ref)


def test_mass_one_keeps_every_block_and_runs_dense() -> None:
    q, k = _qk()
    mask, _ = estimate_block_mask(q, k, block_size=64, mass=1.0, method="sampled")
    assert bool(mask.bool().all())
    cfg = BlockSparseConfig(mass=1.0)
    assert cfg.dense_at(5)


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 1.01, math.nan, math.inf, "0.9", True])
def test_bad_mass_is_refused(bad) -> None:
    q, k = _qk()
    with pytest.raises((ValueError, TypeError), match="mass"):
        estimate_block_mask(q, k, block_size=64, mass=bad)
    with pytest.raises((ValueError, TypeError), match="mass"):
        BlockSparseConfig(mass=bad)


def test_mass_and_density_together_are_refused_saying_which_to_use() -> None:
    q, k = _qk()
    with pytest.raises(ValueError, match="not both"):
        estimate_block_mask(q, k, block_size=64, mass=0.9, keep_ratio=0.5)
    with pytest.raises(ValueError, match="not both"):
        estimate_block_mask(q, k, block_size=64, mass=0.9, keep_ratio=1.0)
    with pytest.raises(ValueError, match="sparsity .*mass|mass.*sparsity"):
        BlockSparseConfig(mass=0.9, sparsity=0.5)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"method": "sampled_layer"}, "per head"),
        ({"forced_blocks": "on_top"}, "in_budget"),
        ({"threshold": 0.5}, "threshold"),
    ],
)
def test_mass_refuses_what_it_cannot_mean(fields, message) -> None:
    with pytest.raises(ValueError, match=message):
        BlockSparseConfig(mass=0.9, **fields)
    with pytest.raises(ValueError, match=message):
        BlockSelection(mass=0.9, **fields)


def test_nan_scores_are_never_kept_and_count_no_mass() -> None:
    scores = torch.rand(1, 1, 4, 6)
    scores[0, 0, 1, 3] = math.nan
    mask, _ = mask_from_scores(
        scores, BlockSelection(mass=0.99, keep_sink=False, keep_recent=False)
    )
    assert not bool(mask[0, 0, 1, 3])
    assert bool((_coverage(scores, mask.bool()) >= 0.99 - 1e-9).all())


def test_sparsity_zero_with_no_mass_stays_dense_and_mass_is_sparse() -> None:
    assert BlockSparseConfig().dense_at(3)
    assert not BlockSparseConfig(mass=0.9).dense_at(3)


def test_the_npu_estimate_kernel_says_it_takes_no_mass_target() -> None:
    from ditops.ops.attention_npu import estimate_reasons

    q, k = _qk()
    call = estimate_block_mask.op.prepare(q, k, block_size=64, mass=0.9, method="antidiagonal")
    reasons = estimate_reasons(call)
    assert reasons and "mass target" in reasons[0]
    dense_call = estimate_block_mask.op.prepare(
        q, k, block_size=64, keep_ratio=0.5, method="antidiagonal"
    )
    assert not any("mass target" in r for r in estimate_reasons(dense_call))
