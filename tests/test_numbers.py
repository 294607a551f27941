"""Numbers of any type where the public API asks for a number (issue 25, item 5).

Any integer type (``operator.index``: numpy's, a 0-d integer tensor) is an int, and any
real number a float holds exactly (``numbers.Real``: numpy's floats) is a float; the
value is kept as a Python int / float, so a config made with numpy numbers equals and
hashes as the one made with Python's. Bools are refused where they were, and a float is
no int (``block_size=64.0`` stays refused).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import ditops
from ditops import BlockSparseAttention, BlockSparseConfig
from ditops.attention.schedule import first_frame_dense_blocks

q = torch.randn(1, 2, 64, 16, generator=torch.Generator().manual_seed(0))
x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(1))


def _layer(**kw: Any) -> BlockSparseAttention:
    return BlockSparseAttention(sparsity=0.25, skip_first_steps=1, block_size=16, stride=4, **kw)


def _stepped(step: Any) -> BlockSparseAttention:
    layer = _layer()
    layer.set_step(step)
    return layer


#: name -> (call with numpy numbers, the same call with Python numbers): equal results
ACCEPTED: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
    "BlockSparseConfig": (
        lambda: BlockSparseConfig(
            sparsity=np.float32(0.5),
            block_size=np.int64(64),
            skip_first_steps=np.int64(2),
            stride=np.int32(8),
            estimate_every=np.int64(2),
            samples=np.uint8(2),
        ),
        lambda: BlockSparseConfig(
            sparsity=0.5, block_size=64, skip_first_steps=2, stride=8, estimate_every=2, samples=2
        ),
    ),
    "BlockSparseConfig.threshold": (
        lambda: BlockSparseConfig(method="antidiagonal", threshold=np.float64(0.9)),
        lambda: BlockSparseConfig(method="antidiagonal", threshold=0.9),
    ),
    "BlockSparseConfig.mass, clusters": (
        lambda: BlockSparseConfig(
            mass=np.float32(0.5), clusters=np.int64(4), method="sampled_head"
        ),
        lambda: BlockSparseConfig(mass=0.5, clusters=4, method="sampled_head"),
    ),
    "BlockSparseConfig 0-d int tensor": (
        lambda: BlockSparseConfig(skip_first_steps=torch.tensor(3)),
        lambda: BlockSparseConfig(skip_first_steps=3),
    ),
    "BlockSparseAttention(dense_blocks)": (
        lambda: _layer(dense_blocks=np.int64(1)).dense_blocks,
        lambda: _layer(dense_blocks=1).dense_blocks,
    ),
    "BlockSparseAttention.set_step": (
        lambda: _stepped(np.int64(1))(q, q, q),
        lambda: _stepped(1)(q, q, q),
    ),
    "BlockSparseAttention(step=, dense_blocks=, scale=)": (
        lambda: _layer()(
            q, q, q, step=np.int64(2), dense_blocks=np.int64(1), scale=np.float32(0.25)
        ),
        lambda: _layer()(q, q, q, step=2, dense_blocks=1, scale=0.25),
    ),
    "first_frame_dense_blocks": (
        lambda: first_frame_dense_blocks((1, 4, np.int64(2), 8, 8), np.int64(2), np.int64(16)),
        lambda: first_frame_dense_blocks((1, 4, 2, 8, 8), 2, 16),
    ),
    "estimate_block_mask": (
        lambda: ditops.estimate_block_mask(
            q,
            q,
            block_size=np.int64(16),
            stride=np.int64(4),
            keep_ratio=np.float32(0.75),
            dense_blocks=np.int64(1),
            samples=np.int64(2),
        ),
        lambda: ditops.estimate_block_mask(
            q, q, block_size=16, stride=4, keep_ratio=0.75, dense_blocks=1, samples=2
        ),
    ),
    "FP32LayerNorm": (
        lambda: ditops.FP32LayerNorm(np.int64(16), eps=np.float32(1e-5))(x),
        lambda: ditops.FP32LayerNorm(16, eps=float(np.float32(1e-5)))(x),
    ),
    "LayerNormScaleShift": (
        lambda: ditops.LayerNormScaleShift(np.int64(16), eps=np.float32(0.5)).normalized_shape,
        lambda: ditops.LayerNormScaleShift(16, eps=0.5).normalized_shape,
    ),
    "RMSNorm": (
        lambda: ditops.RMSNorm(np.int64(16), eps=np.float32(0.5))(x),
        lambda: ditops.RMSNorm(16, eps=0.5)(x),
    ),
    "rms_norm": (
        lambda: ditops.rms_norm(x, torch.ones(16), np.float32(0.5)),
        lambda: ditops.rms_norm(x, torch.ones(16), 0.5),
    ),
    "rms_norm_scale": (
        lambda: ditops.rms_norm_scale(x.reshape(1, -1, 16), torch.ones(16), np.float32(0.5)),
        lambda: ditops.rms_norm_scale(x.reshape(1, -1, 16), torch.ones(16), 0.5),
    ),
}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(u, v) for u, v in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b and type(a) is type(b)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_numpy_numbers_are_accepted_as_python_numbers(name: str) -> None:
    with_numpy, with_python = ACCEPTED[name]
    assert _same(with_numpy(), with_python())


def test_a_config_of_numpy_numbers_keeps_python_numbers() -> None:
    cfg = BlockSparseConfig(sparsity=np.float32(0.5), block_size=np.int64(64))
    assert type(cfg.sparsity) is float and type(cfg.block_size) is int
    assert hash(cfg) == hash(BlockSparseConfig(sparsity=0.5, block_size=64))
    assert repr(cfg) == repr(BlockSparseConfig(sparsity=0.5, block_size=64))


def test_set_step_takes_numpy_integers() -> None:
    from tests.integrations.test_diffusers_wan import tiny_wan

    model = tiny_wan(keep_fp32=False)
    ditops.patch(model, attention=BlockSparseConfig(sparsity=0.5))
    ditops.set_step(model, np.int64(3))
    assert model._ditops_steps.current() == 3 and type(model._ditops_steps.manual) is int


#: name -> a call that must be refused (TypeError or ValueError), as before
REFUSED: dict[str, Callable[[], Any]] = {
    "sparsity=True": lambda: BlockSparseConfig(sparsity=True),
    "sparsity=np.bool_": lambda: BlockSparseConfig(sparsity=np.True_),
    "block_size=True": lambda: BlockSparseConfig(block_size=True),
    "block_size=64.0": lambda: BlockSparseConfig(block_size=64.0),
    "block_size=np.float32(64)": lambda: BlockSparseConfig(block_size=np.float32(64)),
    "skip_first_steps=np.int64(-1)": lambda: BlockSparseConfig(skip_first_steps=np.int64(-1)),
    "skip_first_steps=bool tensor": lambda: BlockSparseConfig(skip_first_steps=torch.tensor(True)),
    "sparsity=float tensor": lambda: BlockSparseConfig(sparsity=torch.tensor(0.5)),
    "sparsity=np.float32(nan)": lambda: BlockSparseConfig(sparsity=np.float32("nan")),
    "samples=True": lambda: BlockSparseConfig(samples=True),
    "dense_blocks=True": lambda: _layer(dense_blocks=True),
    "layer.set_step(True)": lambda: _layer().set_step(True),
    "layer.set_step(-1)": lambda: _layer().set_step(-1),
    "layer.set_step('1')": lambda: _layer().set_step("1"),  # type: ignore[arg-type]
    "layer(step=1.0)": lambda: _layer()(q, q, q, step=1.0),  # type: ignore[arg-type]
    "RMSNorm(3.5)": lambda: ditops.RMSNorm(3.5),  # type: ignore[arg-type]
    "RMSNorm(True)": lambda: ditops.RMSNorm(True),
    "RMSNorm(0)": lambda: ditops.RMSNorm(0),
    "RMSNorm(eps='a')": lambda: ditops.RMSNorm(16, eps="a"),  # type: ignore[arg-type]
    "LayerNormScaleShift(True)": lambda: ditops.LayerNormScaleShift(True),
    "LayerNormScaleShift(2.5)": lambda: ditops.LayerNormScaleShift(2.5),  # type: ignore[arg-type]
    "LayerNormScaleShift([4, 4])": lambda: ditops.LayerNormScaleShift([4, 4]),
    "LayerNormScaleShift(eps=True)": lambda: ditops.LayerNormScaleShift(4, eps=True),
    "first_frame_dense_blocks(patch=2.0)": lambda: first_frame_dense_blocks((1, 4, 2, 8, 8), 2.0),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_what_is_not_the_number_asked_is_refused(name: str) -> None:
    with pytest.raises((TypeError, ValueError)):
        REFUSED[name]()
