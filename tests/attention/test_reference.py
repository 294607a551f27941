"""The reference block-sparse attention against a float64 dense oracle."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import ditops.attention.reference as reference_mod
from ditops.attention.layout import CHUNK_ELEMENTS, plan_chunks
from ditops.attention.reference import block_sparse_attention_reference
from tests.attention.helpers import dense_oracle, random_mask


def qkv(heads: int, kv_heads: int, seq: int, dim: int, dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, seq, dim, generator=gen).to(dtype)
    k = torch.randn(1, kv_heads, seq, dim, generator=gen).to(dtype)
    v = torch.randn(1, kv_heads, seq, dim, generator=gen).to(dtype)
    return q, k, v


@pytest.mark.parametrize(
    ("seq", "block", "causal", "heads"),
    [
        (1000, 128, False, (2, 2)),
        (1000, 128, True, (4, 2)),
        (200, 64, False, (4, 2)),
        (200, 64, True, (2, 2)),
        (4097, 512, True, (2, 1)),
    ],
)
def test_matches_dense_oracle(seq: int, block: int, causal: bool, heads: tuple) -> None:
    q, k, v = qkv(*heads, seq, 16)
    blocks = -(-seq // block)
    mask, _ = random_mask(1, heads[0], blocks, blocks, seed=seq)
    out = block_sparse_attention_reference(q, k, v, mask, causal=causal, block_size=block)
    want = dense_oracle(q, k, v, mask, block_size=block, causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    # fp32 against a float64 oracle; 1e-5 leaves room for thread-dependent summation order
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert bool((out[:, :, :block] == 0).all())  # block row 0 selects nothing


def test_bsnd_layout_gives_the_same_output() -> None:
    q, k, v = qkv(4, 2, 300, 32)
    mask, _ = random_mask(1, 4, 3, 3)
    want = block_sparse_attention_reference(q, k, v, mask, block_size=128)
    out = block_sparse_attention_reference(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        mask,
        layout="BSND",
        block_size=128,
    )
    assert out.is_contiguous() and out.shape == (1, 300, 4, 32)
    assert torch.equal(out.transpose(1, 2), want)


@pytest.mark.parametrize("causal", [False, True])
def test_full_mask_is_dense_sdpa(causal: bool) -> None:
    q, k, v = qkv(2, 1, 700, 32)
    mask = torch.ones(1, 2, 6, 6, dtype=torch.int8)
    out = block_sparse_attention_reference(q, k, v, mask, causal=causal, block_size=128)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_low_precision_output_is_the_fp32_result_rounded() -> None:
    q, k, v = qkv(2, 2, 300, 32, dtype=torch.bfloat16)
    mask, _ = random_mask(1, 2, 3, 3)
    out = block_sparse_attention_reference(q, k, v, mask, block_size=128, scale=0.2)
    want = block_sparse_attention_reference(
        q.float(), k.float(), v.float(), mask, block_size=128, scale=0.2
    )
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, want.bfloat16())


def test_chunking_does_not_change_the_result(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = qkv(4, 2, 1000, 16)
    mask, _ = random_mask(1, 4, 8, 8)
    want = block_sparse_attention_reference(q, k, v, mask, causal=True, block_size=128)
    monkeypatch.setattr(
        reference_mod, "plan_chunks", functools.partial(plan_chunks, budget=256 * 1000)
    )
    got = block_sparse_attention_reference(q, k, v, mask, causal=True, block_size=128)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_memory_is_bounded_at_32k_tokens() -> None:
    for heads, seq in [(12, 32768), (40, 75600), (1, 1000)]:
        h, rows = plan_chunks(heads, seq, seq, 128)
        assert h * rows * seq <= max(CHUNK_ELEMENTS, 128 * seq)
        assert rows == seq or rows % 128 == 0
    assert plan_chunks(12, 32768, 32768, 128) == (1, 128)
    assert plan_chunks(12, 1024, 1024, 128) == (4, 1024)


def test_gradients_flow() -> None:
    q, k, v = qkv(2, 1, 200, 16)
    for t in (q, k, v):
        t.requires_grad_(True)
    mask, _ = random_mask(1, 2, 2, 2, density=1.0)
    out = block_sparse_attention_reference(q, k, v, mask, block_size=128)
    out.square().sum().backward()
    assert all(t.grad is not None and bool(t.grad.isfinite().all()) for t in (q, k, v))


def test_batches_are_independent() -> None:
    q, k, v = qkv(2, 1, 300, 16)
    q2, k2, v2 = qkv(2, 1, 300, 16, seed=1)
    mask, _ = random_mask(2, 2, 3, 3)
    out = block_sparse_attention_reference(
        torch.cat([q, q2]), torch.cat([k, k2]), torch.cat([v, v2]), mask, block_size=128
    )
    for b, (qb, kb, vb) in enumerate([(q, k, v), (q2, k2, v2)]):
        want = dense_oracle(qb, kb, vb, mask[b : b + 1], block_size=128)
        torch.testing.assert_close(out[b : b + 1], want, atol=2e-6, rtol=1e-5)
