"""The ops alone at their edges (issue 25's sweep): empty tensors, non-contiguous views,
NaN and inf, fp16 near overflow, fp32. In exact precision each op's chosen path is
bitwise its meaning (the op with every custom path off), NaN where the meaning has NaN;
the sparse attention layer takes empty and ragged shapes and refuses a zero head dim
when called (it raised ZeroDivisionError)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import ditops
from ditops import BlockSparseAttention

C = 32


def _r(*shape: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _poisoned(value: float) -> torch.Tensor:
    return _r(2, 8, C).index_fill_(1, torch.tensor([3]), value)


#: name -> activations [B, L, C]
INPUTS: dict[str, Callable[[], torch.Tensor]] = {
    "plain": lambda: _r(2, 8, C),
    "empty rows": lambda: _r(2, 0, C),
    "empty batch": lambda: _r(0, 8, C),
    "non-contiguous": lambda: _r(2, C, 8).transpose(1, 2),
    "nan": lambda: _poisoned(float("nan")),
    "inf": lambda: _poisoned(float("inf")),
    "fp16 near overflow": lambda: (_r(2, 8, C, dtype=torch.float32) * 6e4).half(),
    "fp32": lambda: _r(2, 8, C, dtype=torch.float32),
}


def _ops(x: torch.Tensor) -> dict[str, Callable[[], object]]:
    b = x.shape[0]
    scale, shift, gate = (_r(b, 1, C, dtype=torch.float32, seed=s) for s in (1, 2, 3))
    mscale, mshift = (_r(b, 1, C, dtype=x.dtype, seed=s) for s in (4, 5))
    weight = _r(C, dtype=x.dtype, seed=6)
    norm = ditops.FP32LayerNorm(C, eps=1e-6)
    return {
        "layer_norm_scale_shift": lambda: ditops.layer_norm_scale_shift(
            x, None, None, scale, shift, 1e-6
        ),
        "scale_residual_layer_norm_scale_shift": lambda: (
            ditops.scale_residual_layer_norm_scale_shift(x, x, gate, None, None, scale, shift, 1e-6)
        ),
        "gated_residual": lambda: ditops.gated_residual(x, x, gate),
        "rms_norm": lambda: ditops.rms_norm(x, weight, 1e-6),
        "rms_norm_scale": lambda: ditops.rms_norm_scale(x, mscale, 1e-6, weight=weight),
        "FP32LayerNorm": lambda: norm(x),
        "adaln_modulate": lambda: ditops.adaln_modulate(x, mscale, mshift, 1e-6),
    }


def _first(out: object) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out  # type: ignore[return-value]


@pytest.mark.parametrize("op", sorted(_ops(_r(1, 1, C))))
@pytest.mark.parametrize("inputs", sorted(INPUTS))
def test_each_op_is_its_meaning_at_the_edges(inputs: str, op: str) -> None:
    x = INPUTS[inputs]()
    call = _ops(x)[op]
    with ditops.override(precision="exact"):
        out = _first(call())
    with ditops.override(custom_ops="none", precision="exact"):
        meaning = _first(call())
    torch.testing.assert_close(out, meaning, rtol=0, atol=0, equal_nan=True)


def _layer() -> BlockSparseAttention:
    return BlockSparseAttention(sparsity=0.5, block_size=16, stride=4)


#: name -> (q, k/v) BNSD shapes the sparse layer takes, giving q's shape back
SHAPES = {
    "empty sequence": ((1, 2, 0, 16), (1, 2, 0, 16)),
    "empty batch": ((0, 2, 64, 16), (0, 2, 64, 16)),
    "sequence not a multiple of the block": ((1, 2, 70, 16), (1, 2, 70, 16)),
    "fewer queries than keys": ((1, 2, 32, 16), (1, 2, 64, 16)),
    "one token": ((1, 2, 1, 16), (1, 2, 1, 16)),
    "grouped query heads": ((1, 4, 64, 16), (1, 2, 64, 16)),
}


@pytest.mark.parametrize("case", sorted(SHAPES))
def test_the_sparse_layer_takes_edge_shapes(case: str) -> None:
    q_shape, kv_shape = SHAPES[case]
    q, k, v = (
        _r(*q_shape, dtype=torch.float32),
        _r(*kv_shape, seed=1, dtype=torch.float32),
        _r(*kv_shape, seed=2, dtype=torch.float32),
    )
    assert _layer()(q, k, v).shape == q.shape


def test_a_non_contiguous_view_gives_what_its_copy_gives() -> None:
    x = _r(1, 64, 2, 16, dtype=torch.float32).transpose(1, 2)
    assert torch.equal(_layer()(x, x, x), _layer()(x.contiguous(), x.contiguous(), x.contiguous()))


@pytest.mark.parametrize("shape", [(1, 2, 64, 0), (1, 0, 64, 16)], ids=["head dim 0", "no heads"])
def test_zero_heads_or_head_dim_are_refused_saying_so(shape: tuple) -> None:
    z = torch.zeros(shape)
    with pytest.raises(ValueError, match="heads and head dim must be >= 1"):
        _layer()(z, z, z)
