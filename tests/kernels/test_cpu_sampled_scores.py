"""The sampled estimate's fp32 scores with one head per worker thread
(:mod:`ditops.kernels.cpu.sampled_scores`): the same numbers as the 2-D form in
:func:`ditops.attention.methods.sampled_block_scores_fp32`, whichever thread runs a head,
and the estimate's CPU path runs it."""

from __future__ import annotations

import pytest
import torch

from ditops import config
from ditops.attention.methods import sampled_block_scores_fp32, sampled_rows_fp32
from ditops.custom_op import reset_state
from ditops.kernels.cpu import sampled_scores, workers
from ditops.ops import estimate_block_mask as estimate_op
from ditops.ops.estimate_block_mask import estimate_block_mask


def per_worker(q, k, *, block_size, samples, scale, causal):
    kv_len = int(k.shape[2])
    qs, allowed = sampled_rows_fp32(
        q, kv_len, block_size=block_size, samples=samples, scale=scale, causal=causal
    )
    return sampled_scores.sampled_block_scores_fp32(
        qs, k, allowed, block_size=block_size, samples=samples, kv_blocks=-(-kv_len // block_size)
    )


@pytest.mark.parametrize("n_workers", [1, 2])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "q_len", "kv_len", "causal", "bsnd"),
    [
        (4, 4, 256, 256, False, False),
        (4, 2, 200, 230, False, True),  # GQA, partial last blocks, BSND strides
        (3, 1, 256, 256, True, False),
        (2, 2, 130, 300, True, True),
    ],
)
def test_same_numbers_as_the_2d_form(
    monkeypatch, n_workers, heads, kv_heads, q_len, kv_len, causal, bsnd
) -> None:
    monkeypatch.setattr(workers, "WORKERS", n_workers)
    monkeypatch.setattr(sampled_scores, "ROW_CHUNK", 8)  # several row chunks per head
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, q_len, heads, 16, generator=g).to(torch.bfloat16)
    k = torch.randn(2, kv_len, kv_heads, 16, generator=g).to(torch.bfloat16)
    if not bsnd:
        q, k = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
    q, k = q.transpose(1, 2), k.transpose(1, 2)  # BNSD views
    opts = {"block_size": 32, "samples": 3, "scale": 0.25, "causal": causal}
    want = sampled_block_scores_fp32(q, k, **opts)
    got = per_worker(q, k, **opts)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert torch.equal(per_worker(q, k, **opts), got)  # the same bits on a second call


def test_nan_spreads_to_the_rows_that_read_it() -> None:
    q = torch.randn(1, 2, 64, 16).to(torch.bfloat16)
    k = torch.randn(1, 2, 64, 16).to(torch.bfloat16)
    k[0, 1, 5] = float("nan")
    got = per_worker(q, k, block_size=32, samples=2, scale=0.25, causal=False)
    assert got[0, 1].isnan().all() and not got[0, 0].isnan().any()


def test_the_estimate_cpu_path_runs_it(monkeypatch) -> None:
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(estimate_op, "amx_tiles", lambda: False)
    calls = []
    real = sampled_scores.sampled_block_scores_fp32

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(sampled_scores, "sampled_block_scores_fp32", spy)
    threads = []
    real_select = estimate_op.mask_from_scores

    def select_spy(*args, **kwargs):
        threads.append(torch.get_num_threads())
        return real_select(*args, **kwargs)

    monkeypatch.setattr(estimate_op, "mask_from_scores", select_spy)
    reset_state()
    q = torch.randn(1, 2, 256, 16).to(torch.bfloat16)
    k = torch.randn(1, 2, 256, 16).to(torch.bfloat16)
    with torch.inference_mode(), config.override(strict=True):
        estimate_block_mask(q, k, keep_ratio=0.5, method="sampled", block_size=32)
    reset_state()
    assert calls == [1]
    assert threads == [1]  # the selection's small ops on one thread (no barriers to wait at)
