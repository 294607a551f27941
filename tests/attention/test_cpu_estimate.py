"""The estimate's CPU path: fp32 block scores for bf16/fp16 q and k on CPUs without
AVX-512 (where their matmuls are a slow fallback), and the sampled methods' scores by
fp32 matmul and softmax on CPUs without AMX; the meaning's selection after them.
Masks agree with ``forward_native`` except at near-ties (tests/attention/estimate_ties.py,
the criterion the Triton estimate is held to)."""

from __future__ import annotations

import pytest
import torch

from ditops import config
from ditops.attention.block_mask import row_counts
from ditops.attention.estimate import block_scores
from ditops.attention.methods import sampled_block_scores
from ditops.custom_op import reset_state
from ditops.ops import estimate_block_mask as estimate_op
from ditops.ops.estimate_block_mask import estimate_block_mask
from tests.attention.estimate_ties import ATOL, near_tie_violations, rtol

SMALL = {"block_size": 32, "stride": 4}
CASES = {
    # keep_ratio, threshold, sink, recent, causal, dense_blocks
    "topk": (0.3, 1.0, True, True, False, 0),
    "threshold": (1.0, 0.6, False, True, False, 0),
    "both_causal": (0.4, 0.8, True, False, True, 2),
}


@pytest.fixture
def no_avx512(monkeypatch: pytest.MonkeyPatch) -> None:
    """The machine the path is for (CI's may have AVX-512)."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    reset_state()
    yield
    reset_state()


def qk(dtype: torch.dtype, seed: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, 420, 16, generator=gen).to(dtype)
    return q, torch.randn(1, 2, 420, 16, generator=gen).to(dtype)


@pytest.mark.parametrize("layout", ["BNSD", "BSND"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_masks_match_native_except_near_ties(no_avx512, dtype, case, layout) -> None:
    keep_ratio, threshold, sink, recent, causal, dense = CASES[case]
    opts = {
        "keep_ratio": keep_ratio,
        "threshold": threshold,
        "keep_sink": sink,
        "keep_recent": recent,
        "causal": causal,
        "dense_blocks": dense,
    }
    q, k = qk(dtype)
    qi, ki = (q, k) if layout == "BNSD" else (q.transpose(1, 2), k.transpose(1, 2))
    with torch.inference_mode(), config.override(strict=True):
        assert estimate_block_mask.op.explain_call(
            qi, ki, layout=layout, **opts, **SMALL
        ).chosen == ("forward_cpu")
        mask, counts = estimate_block_mask(qi, ki, layout=layout, **opts, **SMALL)
        with config.override(custom_ops="-estimate_block_mask"):
            want, _ = estimate_block_mask(qi, ki, layout=layout, **opts, **SMALL)
    assert mask.dtype == torch.int8 and torch.equal(counts, row_counts(mask))
    scores = block_scores(q, k, score_scale=16**-0.5 / 4, causal=causal, **SMALL)
    assert near_tie_violations(mask, want, scores, (rtol(dtype, 1), ATOL), **opts) == []
    assert int((mask != want).sum()) <= 0.01 * mask.numel()


def test_fp32_and_avx512_machines_run_the_meaning(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k = qk(torch.float32)
    reset_state()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    with torch.inference_mode():
        assert estimate_block_mask.op.explain_call(q, k, **SMALL).chosen == "forward_native"
        reset_state()
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
        explained = estimate_block_mask.op.explain_call(q.bfloat16(), k.bfloat16(), **SMALL)
        assert explained.chosen == "forward_native"
        assert "multiplies bf16/fp16 natively" in str(explained)
    reset_state()


def test_nan_spreads_as_in_the_meaning(no_avx512) -> None:
    q, k = qk(torch.bfloat16)
    k[0, 1, 100, 3] = float("nan")
    with torch.inference_mode():
        got = estimate_block_mask(q, k, keep_ratio=0.3, **SMALL)
        with config.override(custom_ops="-estimate_block_mask"):
            want = estimate_block_mask(q, k, keep_ratio=0.3, **SMALL)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.fixture
def avx512_no_amx(monkeypatch: pytest.MonkeyPatch) -> None:
    """The AVX-512 EPYC the sampled scores' fp32 form was measured on (no AMX)."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(estimate_op, "amx_tiles", lambda: False)
    reset_state()
    yield
    reset_state()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sampled_scores_in_fp32_on_cpus_without_amx(avx512_no_amx, dtype, causal) -> None:
    opts = {
        "keep_ratio": 0.3,
        "threshold": 1.0,
        "keep_sink": True,
        "keep_recent": True,
        "causal": causal,
        "dense_blocks": 1,
        "method": "sampled",
        "samples": 3,
    }
    q, k = qk(dtype)
    with torch.inference_mode(), config.override(strict=True):
        assert estimate_block_mask.op.explain_call(q, k, **opts, **SMALL).chosen == "forward_cpu"
        mask, counts = estimate_block_mask(q, k, **opts, **SMALL)
        with config.override(custom_ops="-estimate_block_mask"):
            want, _ = estimate_block_mask(q, k, **opts, **SMALL)
    assert mask.dtype == torch.int8 and torch.equal(counts, row_counts(mask))
    scores = sampled_block_scores(
        q.double(), k.double(), block_size=32, samples=3, scale=16**-0.5, causal=causal
    ).float()
    assert near_tie_violations(mask, want, scores, (rtol(dtype, 1), ATOL), **opts) == []
    assert int((mask != want).sum()) <= 0.01 * mask.numel()


def test_amx_cpus_keep_the_flash_kernel_for_sampled_scores(monkeypatch) -> None:
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(estimate_op, "amx_tiles", lambda: True)
    reset_state()
    q, k = qk(torch.bfloat16)
    with torch.inference_mode():
        explained = estimate_block_mask.op.explain_call(q, k, method="sampled", **SMALL)
    reset_state()
    assert explained.chosen == "forward_native" and "AMX tiles" in str(explained)
