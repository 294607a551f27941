"""The video-like attention generator and the two oracles (tiny shapes, fp32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ditops.bench.video_attention import (
    exact_block_mass,
    head_kinds,
    mask_quality,
    oracle_per_head,
    oracle_per_row,
    video_attention,
)


def probs(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return torch.softmax(q[0] @ k[0].transpose(-1, -2) * q.shape[-1] ** -0.5, dim=-1)


def test_deterministic_from_the_seed() -> None:
    a = video_attention(3, 4, 6, heads=4, dim=24, seed=5)
    b = video_attention(3, 4, 6, heads=4, dim=24, seed=5)
    c = video_attention(3, 4, 6, heads=4, dim=24, seed=6)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], c[0])
    assert a[0].shape == a[1].shape == a[2].shape == (1, 4, 72, 24)
    with pytest.raises(ValueError, match="dim must be even"):
        video_attention(3, 4, 6, dim=8)


def test_heads_attend_as_their_kind_says() -> None:
    frames, h, w = 6, 8, 8
    q, k, _ = video_attention(frames, h, w, heads=4, dim=72, seed=1, sinks=0)
    p = probs(q, k).view(4, frames, h * w, frames, h * w)
    same_frame = p.diagonal(dim1=1, dim2=3).sum(dim=(1, 2, 3)) / (frames * h * w)
    same_place = p.diagonal(dim1=2, dim2=4).sum(dim=(1, 2, 3)) / (frames * h * w)
    kinds = head_kinds(4)
    assert kinds == ["spatial", "temporal", "mixed", "diffuse"]
    assert same_frame[0] > 0.9  # spatial: its own frame
    assert same_place[1] > 0.3 > same_frame[1] * 0.5  # temporal: the same place, across time


def test_the_diffuse_head_is_the_flattest() -> None:
    q, k, _ = video_attention(6, 16, 16, heads=4, dim=72, seed=1, sinks=0)
    p = probs(q, k)
    entropy = -(p * p.clamp(min=1e-30).log()).sum(-1).mean(-1)
    assert int(entropy.argmax()) == 3 and float(entropy[3]) > 2 * float(entropy[:3].max())


def test_global_tokens_draw_attention() -> None:
    q, k, _ = video_attention(4, 6, 8, heads=4, dim=24, seed=2, sinks=3)
    per_key = probs(q, k).mean(-2)  # [H, S]: the attention each key gets
    # Token 0 is always a global token: far above a typical key, in every head.
    assert bool((per_key[:, 0] > 4 * per_key.median(-1).values).all())


def test_oracles_keep_counts_forced_blocks_and_the_most_mass() -> None:
    q, k, v = video_attention(4, 8, 8, heads=2, dim=24, seed=0)  # 256 tokens, 8 blocks
    mass = exact_block_mass(q, k, block_size=32)
    torch.testing.assert_close(mass.sum(-1), torch.full((1, 2, 8), 32.0))
    gen = torch.Generator().manual_seed(0)
    mask = (torch.rand(1, 2, 8, 8, generator=gen) < 0.3).to(torch.int8)
    forced = torch.zeros(8, 8, dtype=torch.bool)
    forced[:, 0] = True
    mask[..., 0] = 1
    row, head = oracle_per_row(mass, mask, forced), oracle_per_head(mass, mask, forced)
    assert torch.equal(row.sum(-1), mask.sum(-1))
    assert torch.equal(head.sum(dim=(-1, -2)), mask.sum(dim=(-1, -2)))
    assert bool(row[..., 0].all()) and bool(head[..., 0].all())

    def kept(m: torch.Tensor) -> torch.Tensor:
        return (mass * m).sum(dim=(-1, -2))

    assert bool((kept(mask) <= kept(row) + 1e-4).all())
    assert bool((kept(row) <= kept(head) + 1e-4).all())
    dense = F.scaled_dot_product_attention(q, k, v)
    quality = mask_quality(mass, row, q, k, v, dense, forced=forced, block_size=32)
    assert quality.mass_vs_row == pytest.approx(1.0)
    assert quality.rel_err == pytest.approx(quality.row_oracle_err)
    assert quality.mass_vs_head <= 1.0 + 1e-6 and 0 < quality.rel_err < 1
    worse = mask_quality(mass, mask, q, k, v, dense, forced=forced, block_size=32)
    assert worse.mass_vs_row < 1 and worse.err_vs_row_oracle > 1
