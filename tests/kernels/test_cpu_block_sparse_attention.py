"""The CPU block-sparse attention kernel (gathered keys + SDPA) against forward_native.

No compilation: every case runs in milliseconds. The kernel takes BNSD views (the op
passes ``to_bnsd`` of its inputs) and returns the layout's contiguous output.
"""

from __future__ import annotations

import threading

import pytest
import torch

import ditops.kernels.cpu.block_sparse_attention as kernel
from ditops.attention.block_mask import num_blocks
from ditops.attention.layout import to_bnsd
from ditops.ops.block_sparse_attention import block_sparse_attention
from tests.attention.helpers import dense_oracle, random_mask
from tests.ops.test_block_sparse_attention import (
    assert_attention_close,
    bsnd,
    native_attention,
    qkv,
)

gathered = kernel.gathered_block_sparse_attention


def run(q, k, v, mask, *, layout="BNSD", causal=False, block_size=128, scale=None):
    """The kernel as forward_cpu calls it, on inputs given in ``layout``."""
    qb, kb, vb = (to_bnsd(t, layout) for t in (q, k, v))
    scale = qb.shape[-1] ** -0.5 if scale is None else scale
    with torch.no_grad():
        return gathered(qb, kb, vb, mask, scale, causal, block_size, layout == "BSND")


def check(q, k, v, mask, counts, **kw) -> torch.Tensor:
    """Run the kernel and compare with native within the op's fast tolerance."""
    out = run(q, k, v, mask, **kw)
    want = native_attention(q, k, v, mask, counts, **kw)
    assert out.is_contiguous()
    assert_attention_close(out, want, v)
    return out


CASES = {
    # heads, kv_heads, q_len, kv_len, dim, block
    "aligned MHA": (2, 2, 512, 512, 32, 128),
    "odd lengths GQA": (4, 2, 1000, 1000, 64, 128),
    "partial last blocks": (2, 1, 300, 300, 16, 64),
    "cross, more queries": (2, 2, 257, 130, 16, 32),
    "cross, more keys": (2, 2, 130, 257, 16, 32),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("layout", ["BNSD", "BSND"])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_native(case: str, layout: str, causal: bool) -> None:
    heads, kv_heads, q_len, kv_len, dim, block = CASES[case]
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, heads, q_len, dim, generator=gen)
    k = torch.randn(1, kv_heads, kv_len, dim, generator=gen)
    v = torch.randn(1, kv_heads, kv_len, dim, generator=gen)
    mask, counts = random_mask(
        1, heads, num_blocks(q_len, block), num_blocks(kv_len, block), seed=len(case)
    )
    if layout == "BSND":
        q, k, v = bsnd(q, k, v)
    out = check(q, k, v, mask, counts, layout=layout, causal=causal, block_size=block)
    # The first row selects nothing: its queries output exact zeros.
    first = out[:, :, :block] if layout == "BNSD" else out[:, :block]
    assert bool((first == 0).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dtypes(dtype: torch.dtype) -> None:
    q, k, v = qkv(4, 2, 700, 32, dtype)
    mask, counts = random_mask(1, 4, 6, 6, seed=5)
    out = check(q, k, v, mask, counts, causal=dtype == torch.float16)
    assert out.dtype == dtype


def test_against_a_float64_oracle() -> None:
    """Not only close to native: close to the exact answer (fp32 inputs)."""
    q, k, v = qkv(2, 1, 333, 16, torch.float32, seed=7)
    mask, _ = random_mask(1, 2, 11, 11, seed=7)
    out = run(q, k, v, mask, causal=True, block_size=32, scale=0.3)
    want = dense_oracle(q, k, v, mask, block_size=32, causal=True, scale=0.3)
    torch.testing.assert_close(out, want, atol=2e-6, rtol=2e-6)


def test_scale_and_a_different_value_dim() -> None:
    gen = torch.Generator().manual_seed(8)
    q, k = torch.randn(1, 2, 300, 32, generator=gen), torch.randn(1, 2, 300, 32, generator=gen)
    v = torch.randn(1, 2, 300, 48, generator=gen)
    mask, counts = random_mask(1, 2, 3, 3, seed=8)
    out = check(q, k, v, mask, counts, scale=0.05)
    assert out.shape == (1, 2, 300, 48)


def test_strided_inputs_gather_without_a_copy() -> None:
    """Slices of a packed [B, S, 3, N, D] qkv tensor (row-aligned strides) and a tensor
    whose head dim is not contiguous (copied first) give the same answer."""
    gen = torch.Generator().manual_seed(9)
    packed = torch.randn(1, 640, 3, 2, 32, generator=gen)
    q, k, v = (packed[:, :, i] for i in range(3))  # BSND views, not contiguous
    assert not q.is_contiguous()
    mask, counts = random_mask(1, 2, 5, 5, seed=9)
    want = native_attention(q, k, v, mask, counts, layout="BSND")
    assert_attention_close(run(q, k, v, mask, layout="BSND"), want, v)
    odd = torch.randn(1, 2, 32, 640, generator=gen).transpose(2, 3)  # D stride != 1
    want = native_attention(odd, odd, odd, mask, counts)
    assert_attention_close(run(odd, odd, odd, mask), want, odd)


@pytest.mark.parametrize("workspace", [1, 64 * 1024])
def test_chunks_give_the_same_answer(monkeypatch: pytest.MonkeyPatch, workspace: int) -> None:
    """Tiny workspaces split every bucket into one-row chunks; the result is the same."""
    q, k, v = qkv(2, 2, 1024, 32, torch.bfloat16)
    mask, counts = random_mask(1, 2, 8, 8, density=0.5, seed=10)
    whole = run(q, k, v, mask)
    # Few keys per query block (a partial block of 2): chunks are bounded by queries.
    gen = torch.Generator().manual_seed(10)
    qx, kx = torch.randn(1, 2, 257, 16, generator=gen), torch.randn(1, 2, 130, 16, generator=gen)
    cross, _ = random_mask(1, 2, 9, 5, seed=10)
    whole_cross = run(qx, kx, kx, cross, causal=True, block_size=32)
    monkeypatch.setattr(kernel, "WORKSPACE_BYTES", workspace)
    assert torch.equal(run(q, k, v, mask), whole)
    assert torch.equal(run(qx, kx, kx, cross, causal=True, block_size=32), whole_cross)


def test_every_row_selecting_the_same_count_is_one_bucket() -> None:
    """A top-k mask: one bucket whose rows are in order (queries and outputs are views)."""
    mask = torch.zeros(1, 2, 4, 4, dtype=torch.int8)
    mask[..., :2] = 1
    buckets, empty = kernel.plan_buckets(mask, q_len=512, kv_len=512, block_size=128, causal=False)
    assert len(buckets) == 1 and empty.numel() == 0
    assert buckets[0].rows.tolist() == list(range(8))
    q, k, v = qkv(2, 2, 512, 16, torch.float32)
    check(q, k, v, mask, mask.sum(-1, dtype=torch.int32))


def test_plan_buckets_lengths_and_causal_offsets() -> None:
    # 3 query blocks x 3 key blocks of 4; keys: 10 tokens (last block 2), queries 12.
    mask = torch.tensor([[[[1, 1, 1], [0, 1, 1], [0, 0, 0]]]], dtype=torch.int8)
    buckets, empty = kernel.plan_buckets(mask, q_len=12, kv_len=10, block_size=4, causal=False)
    shapes = sorted((b.rows.tolist(), b.q_len, b.kv_len, b.causal_offset) for b in buckets)
    assert shapes == [([0], 4, 10, -1), ([1], 4, 6, -1)]
    assert empty.tolist() == [2]
    buckets, empty = kernel.plan_buckets(mask, q_len=12, kv_len=10, block_size=4, causal=True)
    shapes = sorted(
        (b.rows.tolist(), b.blocks.tolist(), b.kv_len, b.causal_offset) for b in buckets
    )
    # Rows 0 and 1 keep their diagonal block only (4 keys, the mask from key 0 on).
    assert shapes == [([0, 1], [[0], [1]], 4, 0)]
    assert empty.tolist() == [2]


def test_bool_mask_with_padding_columns() -> None:
    """The NPU convention: columns past KVb (padding to 32) are zero and ignored."""
    q, k, v = qkv(2, 2, 300, 16, torch.float32)
    mask, counts = random_mask(1, 2, 3, 3, seed=14)
    padded = torch.zeros(1, 2, 3, 32, dtype=torch.bool)
    padded[..., :3] = mask.bool()
    assert_attention_close(run(q, k, v, padded), native_attention(q, k, v, mask, counts), v)


def test_no_keys_or_no_selected_blocks_give_zeros() -> None:
    q, k, v = qkv(2, 2, 300, 16, torch.float32)
    none = torch.zeros(1, 2, 3, 3, dtype=torch.int8)
    assert bool((run(q, k, v, none) == 0).all())
    out = run(q, k[:, :, :0], v[:, :, :0], torch.zeros(1, 2, 3, 0, dtype=torch.int8))
    assert out.shape == (1, 2, 300, 16) and bool((out == 0).all())


def test_nan_in_a_query_row_gives_a_nan_output_row() -> None:
    """As in the meaning (and dense SDPA): the row that reads a NaN is NaN, others are not."""
    q, k, v = qkv(1, 1, 256, 16, torch.float32)
    mask = torch.ones(1, 1, 2, 2, dtype=torch.int8)
    q[0, 0, 5, 3] = float("nan")
    out = run(q, k, v, mask)
    assert bool(out[0, 0, 5].isnan().all())
    assert not bool(out[0, 0, :5].isnan().any()) and not bool(out[0, 0, 6:].isnan().any())
    k[0, 0, 200, 0] = float("nan")  # a selected key: every query reading it is NaN
    assert bool(run(q, k, v, mask).isnan().all())


def test_concurrent_calls_do_not_share_buffers() -> None:
    """The kept workspace serves one call at a time; a second thread gets its own."""
    q, k, v = qkv(2, 2, 1024, 32, torch.float32)
    mask, _ = random_mask(1, 2, 8, 8, density=0.5, seed=11)
    want = run(q, k, v, mask)
    results: list[torch.Tensor] = []
    threads = [
        threading.Thread(target=lambda: results.append(run(q, k, v, mask))) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and all(torch.equal(r, want) for r in results)
    kernel.release_workspace()
    assert torch.equal(run(q, k, v, mask), want)


def test_the_op_takes_this_path_on_cpu() -> None:
    q, k, v = qkv(4, 2, 1000, 64, torch.bfloat16)
    mask, counts = random_mask(1, 4, 8, 8, seed=12)
    with torch.no_grad():
        decision = block_sparse_attention.op.explain_call(q, k, v, mask, counts)
        out = block_sparse_attention(*bsnd(q, k, v), mask, counts, layout="BSND")
    assert decision.chosen == "forward_cpu"
    assert_attention_close(out.transpose(1, 2), native_attention(q, k, v, mask, counts), v)


@pytest.mark.slow  # dynamo's first trace in a process: several seconds
def test_traced_as_one_opaque_call() -> None:
    """Under torch.compile the kernel is one custom-op node: no graph break."""
    q, k, v = qkv(2, 2, 300, 16, torch.float32)
    mask, counts = random_mask(1, 2, 3, 3, seed=13)

    def f(q, k, v):
        return block_sparse_attention(q, k, v, mask, counts) * 2

    with torch.no_grad():
        out = torch.compile(f, backend="eager", fullgraph=True)(q, k, v)
    assert_attention_close(out / 2, native_attention(q, k, v, mask, counts), v)


def _paired_mask() -> torch.Tensor:
    """[1, 2, 6, 6] rows built so that plan_buckets pairs some neighbours: head 0 blocks
    0/1 select the same keys (a pair, no private items), 2/3 share 2 of 3 (pair plus
    private items), 4/5 share 1 of 4 (below half: served one by one); head 1 blocks 0/1
    are a pair where one side selects nothing more, 2 selects nothing, 4/5 pair."""
    rows = [
        [
            [1, 0, 1, 0, 0, 1],
            [1, 0, 1, 0, 0, 1],
            [0, 1, 1, 0, 1, 0],
            [1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 0, 0],
            [1, 0, 0, 0, 1, 1],
        ],
        [
            [0, 1, 1, 1, 0, 0],
            [0, 1, 1, 0, 0, 0],
            [0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 1],
            [0, 0, 0, 1, 1, 1],
            [1, 0, 0, 1, 1, 1],
        ],
    ]
    return torch.tensor([rows], dtype=torch.int8)


def test_plan_buckets_pairs_neighbouring_query_blocks() -> None:
    buckets, empty = kernel.plan_buckets(
        _paired_mask(), q_len=768, kv_len=768, block_size=128, causal=False, pair=True
    )
    got = {
        kind: sorted(r for b in buckets if b.kind == kind for r in b.rows.tolist())
        for kind in ("pair", "private", "single")
    }
    # Flat rows: head 0 is 0..5, head 1 is 6..11. Row 8 selects nothing.
    assert got == {"pair": [0, 2, 6, 10], "private": [2, 3, 6, 11], "single": [4, 5, 9]}
    assert empty.tolist() == [8]
    pair = next(b for b in buckets if b.kind == "pair" and 2 in b.rows.tolist())
    assert pair.q_len == 256 and pair.kv_len == 2 * 128
    # Causal masks are never paired (each block has its own diagonal).
    buckets, _ = kernel.plan_buckets(
        _paired_mask(), q_len=768, kv_len=768, block_size=128, causal=True, pair=True
    )
    assert {b.kind for b in buckets} == {"single"}


@pytest.mark.parametrize("layout", ["BNSD", "BSND"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pairs_match_native_and_the_unpaired_path(
    monkeypatch: pytest.MonkeyPatch, layout: str, dtype: torch.dtype
) -> None:
    """Pairs (merged with private items through the log-sum-exp) give native's answer,
    with GQA, a partial last query block (never paired) and a row with no key."""
    monkeypatch.setattr(kernel, "PAIR_QUERY_BLOCKS", True)
    gen = torch.Generator().manual_seed(15)
    q = torch.randn(1, 2, 700, 32, generator=gen).to(dtype)  # 6 blocks of 128, last partial
    k = torch.randn(1, 1, 768, 32, generator=gen).to(dtype)
    v = torch.randn(1, 1, 768, 32, generator=gen).to(dtype)
    mask = _paired_mask()
    counts = mask.sum(-1, dtype=torch.int32)
    if layout == "BSND":
        q, k, v = bsnd(q, k, v)
    paired = check(q, k, v, mask, counts, layout=layout)
    monkeypatch.setattr(kernel, "PAIR_QUERY_BLOCKS", False)
    single = check(q, k, v, mask, counts, layout=layout)
    if dtype == torch.float32:
        torch.testing.assert_close(paired, single, atol=2e-6, rtol=2e-6)


def test_the_plan_runs_on_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan is dozens of small ops on the mask: on one thread (each 2-thread region
    waits for a descheduled partner under load); without shared groups the SDPA calls
    keep the process's threads."""
    monkeypatch.setattr(kernel, "SHARE_GROUPS", False)
    seen: dict[str, list[int]] = {"plan": [], "sdpa": []}
    real_plan, real_sdpa = kernel.plan_buckets, kernel.F.scaled_dot_product_attention

    def plan(*args, **kwargs):
        seen["plan"].append(torch.get_num_threads())
        return real_plan(*args, **kwargs)

    def sdpa(*args, **kwargs):
        seen["sdpa"].append(torch.get_num_threads())
        return real_sdpa(*args, **kwargs)

    monkeypatch.setattr(kernel, "plan_buckets", plan)
    monkeypatch.setattr(kernel.F, "scaled_dot_product_attention", sdpa)
    monkeypatch.setattr(kernel, "PAIR_QUERY_BLOCKS", False)
    q, k, v = qkv(2, 2, 256, 32, torch.float32)
    mask = torch.zeros(1, 2, 4, 4, dtype=torch.int8)
    mask[..., 1:3] = 1
    before = torch.get_num_threads()
    run(q, k, v, mask, block_size=64)
    assert seen["plan"] == [1]
    assert seen["sdpa"] and set(seen["sdpa"]) == {before}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_groups_on_worker_threads_give_the_same_bits(
    monkeypatch: pytest.MonkeyPatch, causal: bool, dtype: torch.dtype
) -> None:
    """Groups handed to two worker threads (small groups: many of them, pairs and their
    private items included) give the bits of the groups run in turn on the process's
    threads, and match native."""
    from ditops.kernels.cpu import workers

    monkeypatch.setattr(workers, "WORKERS", 2)
    monkeypatch.setattr(kernel, "SHARED_WORKSPACE_BYTES", 64 * 1024)
    monkeypatch.setattr(kernel, "PAIR_QUERY_BLOCKS", True)
    q, k, v = qkv(4, 2, 1000, 32, dtype)
    mask, counts = random_mask(1, 4, num_blocks(1000, 64), num_blocks(1000, 64), 0.5)
    mask[:, :, 2:6] = mask[:, :, 2:3]  # neighbouring rows alike: pairs
    counts = mask.sum(-1, dtype=torch.int32)
    monkeypatch.setattr(kernel, "SHARE_GROUPS", True)
    shared = check(q, k, v, mask, counts, causal=causal, block_size=64)
    monkeypatch.setattr(kernel, "SHARE_GROUPS", False)
    assert torch.equal(run(q, k, v, mask, causal=causal, block_size=64), shared)
