"""BlockSparseConfig takes numbers and flags of numpy's types as set_step does (scalars
and 0-d arrays), kept as Python values; anything else (tensors too) is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ditops.attention import BlockSparseConfig


@pytest.mark.parametrize("half", [np.array(0.5), np.float32(0.5), np.float64(0.5)])
def test_a_0d_array_or_numpy_float_is_a_number(half: object) -> None:
    cfg = BlockSparseConfig(sparsity=half)  # type: ignore[arg-type]
    assert cfg == BlockSparseConfig(sparsity=0.5) and type(cfg.sparsity) is float
    assert hash(cfg) == hash(BlockSparseConfig(sparsity=0.5))
    mass = BlockSparseConfig(mass=np.array(0.9))  # type: ignore[arg-type]
    assert mass.mass == 0.9 and type(mass.mass) is float


@pytest.mark.parametrize("flag", [np.bool_(True), np.array(True)])
def test_numpy_and_0d_bools_are_flags(flag: object) -> None:
    cfg = BlockSparseConfig(sparsity=0.5, keep_sink=flag, permute=flag)  # type: ignore[arg-type]
    assert cfg.keep_sink is True and cfg.permute is True
    assert cfg == BlockSparseConfig(sparsity=0.5, permute=True)


@pytest.mark.parametrize(
    ("field", "value"),
    [("sparsity", np.array([0.5])), ("sparsity", np.array(True)), ("sparsity", "0.5"),
     ("keep_sink", 1), ("keep_sink", np.array([True])), ("keep_sink", np.int64(1)),
     ("sparsity", torch.tensor(0.5)), ("keep_sink", torch.tensor(True))],
)  # fmt: skip
def test_what_is_not_one_number_or_flag_is_still_refused(field: str, value: object) -> None:
    with pytest.raises(TypeError):
        BlockSparseConfig(**{field: value})  # type: ignore[arg-type]
