"""The attention benchmark's quality measures, on tiny inputs (native paths, no compile)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ditops import config
from ditops.bench import attention as bench


def test_video_qk_is_local() -> None:
    q, k = bench.video_qk(2, 8, 8, heads=2, dim=128, dtype=torch.float32)
    assert q.shape == k.shape == (1, 2, 128, 128)
    p = torch.softmax(q[0] @ k[0].transpose(-1, -2) * 128**-0.5, dim=-1)
    # Each token's own position gets far more than the uniform share of its attention.
    assert float(p.diagonal(dim1=-2, dim2=-1).mean()) > 3 / 128


def test_exact_block_mass_rows_sum_to_block_sizes() -> None:
    q, k = bench.video_qk(1, 10, 10, heads=2, dim=16, dtype=torch.float32)
    mass = bench.exact_block_mass(q, k, block_size=32)
    assert mass.shape == (1, 2, 4, 4)
    torch.testing.assert_close(mass.sum(-1), torch.tensor([32.0, 32, 32, 4]).expand(1, 2, 4))


def test_oracle_masks() -> None:
    scores = torch.tensor([[[[0.1, 0.5, 0.2, 0.9], [0.4, 0.3, 0.2, 0.1]]]])
    oracle = bench._oracle_like(scores, torch.tensor([[[1, 3]]]))
    assert oracle.tolist() == [[[[0, 0, 0, 1], [1, 1, 1, 0]]]]


def test_quality_of_a_dense_keep_is_perfect() -> None:
    q, k = bench.video_qk(4, 16, 24, heads=1, dim=32, dtype=torch.float32)  # 12 blocks
    v = torch.randn(q.shape)
    dense = F.scaled_dot_product_attention(q, k, v)
    with config.override(custom_ops="none"):
        full = bench.quality(q, k, v, 1.0, dense)
        sparse = bench.quality(q, k, v, 0.25, dense)
        framed = bench.quality(q, k, v, 0.5, dense, dense_blocks=3)
    assert full["density"] == 1.0 and full["mass_vs_oracle"] == 1.0
    assert full["rel_err"] < 1e-5 and full["cosine"] > 1 - 1e-9 and full["psnr"] > 100
    # The density asked for is the one that runs, first frame included.
    assert abs(sparse["density"] - 0.25) < 1 / 144 and abs(framed["density"] - 0.5) < 1 / 144
    assert 0.5 < sparse["mass_vs_oracle"] <= 1.0 + 1e-6
    assert sparse["oracle_mass_kept"] >= sparse["mass_kept"] - 1e-6
    assert 0 < sparse["max_abs"] and sparse["cosine"] < 1 and sparse["psnr"] < full["psnr"]


def test_summary_checks_the_targets() -> None:
    def row(variant: str, vs: float, ms: float) -> dict:
        return {
            "suite": "attention",
            "case": "S=8064 keep=0.25",
            "variant": variant,
            "vs_native": vs,
            "median_ms": ms,
            "p_keep": 0.25,
            "p_density": 0.25,
            "p_S": 8064,
        }

    rows = [
        row("native", 1.0, 1000.0),
        row("estimate", 25.0, 40.0),
        row("sparse", 3.3, 303.0),
        row("est+sparse", 2.5, 400.0),
    ]
    (s,) = bench.summary(rows)
    assert s["sparse_target_met"] and s["estimate_share_of_dense"] == 0.04
    assert abs(s["sparse_speedup_times_density"] - 0.825) < 1e-9
    assert (s["dense_ms"], s["estimate_ms"], s["sparse_ms"]) == (1000.0, 40.0, 303.0)
