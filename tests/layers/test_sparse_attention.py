"""The BlockSparseAttention layer: dense at sparsity 0, the dense-then-sparse schedule, the
step it needs, its fast path and its config.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tests.doubles.npu_sparse_attention  # noqa: F401 - registers the fake sparse ops
from ditops import config
from ditops.attention import BlockSparseConfig
from ditops.attention.estimate import estimate_block_mask_reference
from ditops.layers.sparse_attention import BlockSparseAttention, dense_attention
from ditops.ops.estimate_block_mask import estimate_block_mask
from tests.ops.test_block_sparse_attention import (
    SHAPE_A,
    assert_attention_close,
    bsnd,
    native_attention,
    qkv,
)


@pytest.mark.parametrize("layout", ["BNSD", "BSND"])
def test_sparsity_zero_is_dense_sdpa(layout: str) -> None:
    q, k, v = qkv(4, 2, 300, 16, torch.bfloat16)
    layer = BlockSparseAttention(sparsity=0.0)
    args = (q, k, v) if layout == "BNSD" else tuple(bsnd(q, k, v))
    with torch.no_grad():
        out = layer(*args, layout=layout)
    want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    if layout == "BSND":
        want = want.transpose(1, 2)
    assert torch.equal(out, want)


def test_schedule_runs_dense_then_sparse() -> None:
    q, k, v = qkv(2, 2, 1000, 16, torch.float32)
    layer = BlockSparseAttention(sparsity=0.75, skip_first_steps=2, block_size=32, stride=4)
    layer.set_video_shape((1, 16, 5, 16, 16), (1, 2, 2))  # 64 tokens per frame: 2 blocks
    assert layer.dense_blocks == 2
    dense = dense_attention(q, k, v)
    with torch.no_grad(), config.override(custom_ops="none"):
        layer.set_step(1)
        assert torch.equal(layer(q, k, v), dense)
        sparse = layer(q, k, v, step=2)
        mask, counts = estimate_block_mask_reference(
            q, k, block_size=32, stride=4, keep_ratio=0.25, dense_blocks=2, method="sampled"
        )
        want = native_attention(q, k, v, mask, counts, block_size=32)
    assert layer.config.method == "sampled"  # the layer's default
    assert torch.equal(sparse, want)
    assert not torch.allclose(sparse, dense, atol=1e-3)
    assert 0.2 < float(mask.float().mean()) < 0.6


def test_layer_needs_the_step_when_warming_up() -> None:
    q, k, v = qkv(2, 2, 256, 16, torch.float32)
    layer = BlockSparseAttention(sparsity=0.5, skip_first_steps=1)
    with pytest.raises(ValueError, match="needs the denoising step index"):
        layer(q, k, v)


def test_layer_uses_the_cpu_fast_path() -> None:
    q, k, v = qkv(**SHAPE_A)
    layer = BlockSparseAttention(sparsity=0.5)
    with torch.no_grad():
        out = layer(q, k, v)
        mask, counts = estimate_block_mask(q, k, keep_ratio=0.5, method=layer.config.method)
    assert_attention_close(out, native_attention(q, k, v, mask, counts), v)


def test_layer_config_or_fields() -> None:
    cfg = BlockSparseConfig(sparsity=0.5)
    assert BlockSparseAttention(cfg).config is cfg
    assert BlockSparseAttention(sparsity=0.5).config == cfg
    with pytest.raises(TypeError, match="not both"):
        BlockSparseAttention(cfg, sparsity=0.2)
    with pytest.raises(ValueError, match=r"sparsity must be in \[0, 1\)"):
        BlockSparseAttention(sparsity=1.2)
    assert "sparsity=0.5" in repr(BlockSparseAttention(cfg))
