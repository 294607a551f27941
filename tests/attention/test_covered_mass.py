"""covered_mass: the softmax mass a block mask keeps in truth (ditops.attention.mass),
what a mass target covered, since the target is met on the estimate's scores."""

from __future__ import annotations

import torch

from ditops import estimate_block_mask
from ditops.attention import covered_mass


def _qk(heads: int = 2, seq: int = 96, dim: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(1, heads, seq, dim, generator=g), torch.randn(
        1, heads, seq, dim, generator=g
    )


def test_it_is_the_dense_softmax_mass_the_mask_keeps() -> None:
    q, k = _qk()
    mask = (torch.rand(1, 2, 3, 3, generator=torch.Generator().manual_seed(1)) < 0.5).to(torch.int8)
    got = covered_mass(q, k, mask, block_size=32)
    p = torch.softmax(q.double() @ k.double().transpose(-1, -2) * 16**-0.5, dim=-1)
    tokens = mask.bool().repeat_interleave(32, -2).repeat_interleave(32, -1)
    want = (p * tokens).sum(-1).mean(-1).float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    full = covered_mass(q, k, torch.ones(1, 2, 3, 3, dtype=torch.int8), block_size=32)
    torch.testing.assert_close(full, torch.ones(1, 2), rtol=1e-5, atol=1e-5)


def test_a_mass_target_is_met_in_truth_when_the_estimate_sees_every_row() -> None:
    q, k = _qk(seq=128)
    for target in (0.5, 0.8, 0.95):
        mask, _ = estimate_block_mask(q, k, block_size=32, mass=target, samples=32)
        assert (covered_mass(q, k, mask, block_size=32) >= target - 1e-4).all(), target
