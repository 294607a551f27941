"""The sparse-attention schedule: config validation, dense steps, first-frame blocks."""

from __future__ import annotations

import pytest

from ditops.attention.schedule import BlockSparseConfig, first_frame_dense_blocks


def test_defaults_are_dense_and_valid() -> None:
    cfg = BlockSparseConfig()
    assert cfg.sparsity == 0 and cfg.keep_ratio == 1.0
    assert cfg.dense_at(None) and cfg.dense_at(40)


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        ({"sparsity": -0.1}, ValueError, r"sparsity must be in \[0, 1\) .*, got -0.1"),
        ({"sparsity": 1.0}, ValueError, r"\(a density 1 - sparsity in \(0, 1\]\), got 1.0"),
        ({"estimate_every": 0}, ValueError, "estimate_every must be >= 1, got 0"),
        ({"estimate_every": 2.0}, TypeError, "estimate_every must be an int"),
        ({"forced_blocks": "sglang"}, ValueError, r"forced_blocks must be one of \('in_budget'"),
        ({"sparsity": float("nan")}, ValueError, "got NaN"),
        ({"sparsity": "0.5"}, TypeError, "sparsity must be a number"),
        ({"skip_first_steps": -1}, ValueError, "skip_first_steps must be >= 0, got -1"),
        ({"skip_first_steps": 1.5}, TypeError, "skip_first_steps must be an int"),
        ({"skip_first_steps": True}, TypeError, "skip_first_steps must be an int"),
        ({"block_size": 0}, ValueError, "block_size must be >= 1"),
        ({"block_size": 100}, ValueError, "block_size must be a multiple of stride=8, got 100"),
        ({"stride": 0}, ValueError, "stride must be >= 1"),
        ({"threshold": 0.0}, ValueError, r"threshold must be in \(0, 1\], got 0.0"),
        ({"threshold": 1.5}, ValueError, r"threshold must be in \(0, 1\]"),
        ({"keep_sink": 1}, TypeError, "keep_sink must be a bool"),
        ({"keep_recent": None}, TypeError, "keep_recent must be a bool"),
        ({"causal": "no"}, TypeError, "causal must be a bool"),
    ],
)
def test_invalid_values_say_the_allowed_range(fields: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        BlockSparseConfig(**fields)


def test_sparsity_sets_the_keep_ratio() -> None:
    assert BlockSparseConfig(sparsity=0.75).keep_ratio == pytest.approx(0.25)
    assert BlockSparseConfig(sparsity=0).keep_ratio == 1.0


def test_dense_before_skip_first_steps() -> None:
    cfg = BlockSparseConfig(sparsity=0.5, skip_first_steps=2)
    assert [cfg.dense_at(s) for s in range(4)] == [True, True, False, False]
    with pytest.raises(ValueError, match="needs the denoising step index"):
        cfg.dense_at(None)
    with pytest.raises(ValueError, match="step must be >= 0"):
        cfg.dense_at(-1)


def test_no_warm_up_needs_no_step() -> None:
    cfg = BlockSparseConfig(sparsity=0.5)
    assert not cfg.dense_at(None) and not cfg.dense_at(0)


def test_sparsity_zero_is_always_dense() -> None:
    cfg = BlockSparseConfig(sparsity=0.0, skip_first_steps=3)
    assert cfg.dense_at(None) and cfg.dense_at(10)


def test_first_frame_blocks_from_latent_shape_and_patch() -> None:
    # Wan 480x832: latents [B, 16, 21, 60, 104], patch (1, 2, 2): 30 x 52 = 1560 tokens.
    assert first_frame_dense_blocks([1, 16, 21, 60, 104], (1, 2, 2)) == 13  # ceil(1560 / 128)
    assert first_frame_dense_blocks((21, 60, 104), 2, block_size=64) == 25  # ceil(1560 / 64)
    assert first_frame_dense_blocks((1, 16, 16), (2, 2), block_size=64) == 1
    assert first_frame_dense_blocks((1, 17, 17), (2, 2), block_size=64) == 1  # 8 x 8 patches


@pytest.mark.parametrize(
    ("shape", "patch", "message"),
    [
        ((60, 104), 2, "must end in positive"),
        ((1, 0, 8), 2, "must end in positive"),
        ((1, 8, 8), (1, 1, 2, 2), "patch_size must be an int"),
        ((1, 8, 8), 0, "patch sizes must be positive"),
        ((1, 1, 8), 2, "smaller than the patch"),
    ],
)
def test_first_frame_bad_shapes(shape: tuple, patch, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        first_frame_dense_blocks(shape, patch)
