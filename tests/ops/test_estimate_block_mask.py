"""The block-mask estimate op: its NPU paths against forward_native (the doubles of
tests/doubles/npu_sparse_attention.py) and the arguments it refuses.
"""

from __future__ import annotations

import logging

import pytest
import torch

import tests.doubles.npu_sparse_attention  # noqa: F401 - registers the fake sparse ops
from ditops.attention.estimate import estimate_block_mask_reference
from ditops.ops.attention_npu import block_size_reasons, npu_in_budget_ratio
from ditops.ops.estimate_block_mask import estimate_block_mask
from tests.doubles.npu_attentions import fake_attentions
from tests.ops.test_block_sparse_attention import _good, bsnd, npu_package


def integer_qk(heads: int, kv_heads: int, seq: int, dtype: torch.dtype = torch.bfloat16):
    """Scores exact in every dtype: the NPU double and native pick the same blocks."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randint(-1, 2, (1, heads, seq, 16), generator=gen).float()
    k = torch.randint(-1, 2, (1, kv_heads, seq, 16), generator=gen).float()
    k[..., 0] = torch.randint(-3, 4, (1, kv_heads, seq), generator=gen).float()
    q[..., 0] = 1.0
    return q.to(dtype), k.to(dtype)


# sglang's reading: the kernel's own selection, nothing to translate.
ESTIMATE_KW = {
    "block_size": 128,
    "stride": 16,
    "scale": 0.25,
    "threshold": 0.9,
    "keep_ratio": 0.3,
    "keep_sink": True,
    "keep_recent": False,
    "dense_blocks": 2,
    "forced_blocks": "on_top",
}


@pytest.mark.parametrize("package", ["legacy", "current"])
@pytest.mark.parametrize("layout", ["BNSD", "BSND"])
@pytest.mark.parametrize("causal", [False, True])
def test_npu_estimate_matches_native(on_npu, package: str, layout: str, causal: bool) -> None:
    q, k = integer_qk(4, 2, 1500)  # 12 blocks: the top-k cap applies (10 candidates or more)
    if layout == "BSND":
        q, k = bsnd(q, k)
    kw = {**ESTIMATE_KW, "layout": layout, "causal": causal}
    with npu_package(package) as calls, torch.no_grad():
        assert estimate_block_mask.op.explain_call(q, k, **kw).chosen == "forward_npu"
        mask, counts = estimate_block_mask(q, k, **kw)
    # The double computes in fp32 from the (exactly representable) bf16 inputs.
    want_mask, want_counts = estimate_block_mask_reference(q.float(), k.float(), **kw)
    assert mask.shape == (1, 4, 12, 12) and mask.is_contiguous()
    assert torch.equal(mask, want_mask) and torch.equal(counts, want_counts)
    assert bool(mask[..., :2, :].all()) if not causal else bool(mask[..., :, :2].any())
    (call,) = calls.of("sparse_block_estimate")
    assert call[4:] == (
        layout,
        16,
        128,
        4,
        2,
        pytest.approx(0.25 / 16),
        pytest.approx(0.9),
        causal,
        True,
        False,
        pytest.approx(0.3),
    )


@pytest.mark.parametrize("package", ["legacy", "current"])
@pytest.mark.parametrize(("causal", "threshold"), [(False, 1.0), (True, 1.0), (False, 0.9)])
def test_npu_estimate_in_budget_holds_the_meanings_blocks(
    on_npu, package: str, causal: bool, threshold: float
) -> None:
    """ditops' reading on the NPU: the kernel's per-row top-k, asked for the largest row
    budget plus the first frame's columns, keeps every block the meaning keeps."""
    q, k = integer_qk(4, 2, 1500)  # 12 x 12 blocks
    dense = 2 if threshold == 1.0 else 0  # threshold < 1 with a first frame runs native
    kw = {
        "block_size": 128,
        "stride": 16,
        "scale": 0.25,
        "threshold": threshold,
        "keep_ratio": 0.6,
        "keep_sink": True,
        "keep_recent": True,
        "dense_blocks": dense,
        "causal": causal,
    }
    with npu_package(package) as calls, torch.no_grad():
        assert estimate_block_mask.op.explain_call(q, k, **kw).chosen == "forward_npu"
        mask, counts = estimate_block_mask(q, k, **kw)
    want, _ = estimate_block_mask_reference(q.float(), k.float(), **kw)
    assert torch.equal(counts, mask.sum(-1, dtype=torch.int32))
    assert not bool((want.bool() & ~mask.bool()).any())  # every block of the meaning
    # What ran is the kernel's own reading at the ratio ditops computed on the host.
    flags = {n: kw[n] for n in ("keep_sink", "keep_recent", "causal", "dense_blocks")}
    ratio = npu_in_budget_ratio(12, 12, keep_ratio=0.6, **flags)
    (call,) = calls.of("sparse_block_estimate")
    assert call[-1] == pytest.approx(ratio)
    on_top, _ = estimate_block_mask_reference(
        q.float(), k.float(), **{**kw, "keep_ratio": ratio, "forced_blocks": "on_top"}
    )
    assert torch.equal(mask, on_top)
    if not causal:  # at most dense_blocks + 1 blocks more per row than the meaning's
        assert int((mask.sum(-1) - want.sum(-1)).max()) <= dense + 1
        assert float(mask.float().mean()) - 0.6 <= (dense + 1) / 12


@pytest.mark.parametrize("package", ["legacy", "current"])
def test_npu_estimate_in_budget_threshold_with_a_first_frame_runs_native(
    on_npu, package: str
) -> None:
    q, k = integer_qk(4, 2, 1500)
    kw = {"threshold": 0.9, "keep_ratio": 0.4, "dense_blocks": 2}
    with npu_package(package) as calls, torch.no_grad():
        decision = estimate_block_mask.op.explain_call(q, k, **kw)
        mask, counts = estimate_block_mask(q, k, **kw)
        on_top = estimate_block_mask.op.explain_call(q, k, forced_blocks="on_top", **kw)
    assert decision.chosen == "forward_native" and on_top.chosen == "forward_npu"
    assert any("first frame" in r for c in decision.candidates for r in c.reasons)
    assert calls.calls == []
    want = estimate_block_mask_reference(q, k, **kw)
    assert torch.equal(mask, want[0]) and torch.equal(counts, want[1])


@pytest.mark.parametrize("package", ["legacy", "current"])
def test_npu_estimate_cross_attention_runs_native(on_npu, package: str) -> None:
    q, _ = integer_qk(2, 2, 512)
    _, k = integer_qk(2, 2, 256)
    with npu_package(package) as calls, torch.no_grad():
        decision = estimate_block_mask.op.explain_call(q, k, layout="BNSD")
        mask, _ = estimate_block_mask(q, k)
    assert decision.chosen == "forward_native"
    assert "used for self-attention only" in decision.candidates[0].reasons[0]
    assert calls.calls == [] and mask.shape == (1, 2, 4, 2)


def test_npu_estimate_missing_op_falls_back(on_npu, caplog, ditops_warnings) -> None:
    q, k = integer_qk(2, 2, 300)
    with fake_attentions(ops=["ada_block_sparse_attention"]), torch.no_grad():
        with caplog.at_level(logging.WARNING):
            mask, counts = estimate_block_mask(q, k, keep_ratio=0.5, forced_blocks="on_top")
    want = estimate_block_mask_reference(q, k, keep_ratio=0.5, forced_blocks="on_top")
    assert torch.equal(mask, want[0]) and torch.equal(counts, want[1])
    (warning,) = ditops_warnings()
    assert "torch.ops.attentions.sparse_block_estimate" in warning
    assert "sgl_kernel_npu is not installed" in warning


@pytest.mark.parametrize("package", ["legacy", "current"])
@pytest.mark.parametrize(
    ("kw", "reason"),
    [
        ({"block_size": 64, "stride": 8}, "block_size 64: the NPU kernels take a multiple of 128"),
        ({"block_size": 640, "stride": 8}, "in [128, 512]"),
        ({"block_size": 256, "stride": 3}, "stride 3 does not divide block_size 256"),
    ],
)
def test_npu_estimate_ineligible_calls_run_native(
    on_npu, package: str, kw: dict, reason: str, ditops_warnings
) -> None:
    q, k = integer_qk(2, 2, 300)
    if kw["block_size"] % kw["stride"]:
        # The op itself refuses it (a call is prepared before any path is explained); the
        # NPU path's own limit says the same.
        with pytest.raises(ValueError, match="must be a multiple of stride"):
            estimate_block_mask.op.explain_call(q, k, **kw)
        assert any(reason in r for r in block_size_reasons(kw["block_size"], kw["stride"]))
        return
    with npu_package(package) as calls, torch.no_grad():
        decision = estimate_block_mask.op.explain_call(q, k, **kw)
        mask, counts = estimate_block_mask(q, k, **kw)
        want = estimate_block_mask_reference(q, k, **kw)
        assert torch.equal(mask, want[0]) and torch.equal(counts, want[1])
        # an eligible call afterwards still takes the kernel: nothing was given up
        estimate_block_mask(q, k, forced_blocks="on_top")
    assert decision.chosen == "forward_native"
    assert any(reason in r for r in decision.candidates[0].reasons), decision
    assert len(calls.of("sparse_block_estimate")) == 1 and not ditops_warnings()


@pytest.mark.parametrize(
    ("kw", "error", "message"),
    [
        ({"stride": 0}, ValueError, "stride must be a positive int"),
        ({"block_size": 100}, ValueError, r"block_size \(100\) must be a multiple of stride"),
        ({"keep_ratio": 0.0}, ValueError, r"keep_ratio must be in \(0, 1\]"),
        ({"keep_ratio": 1.5}, ValueError, r"keep_ratio must be in \(0, 1\]"),
        ({"threshold": 0}, ValueError, "threshold must be a number > 0"),
        ({"dense_blocks": -1}, ValueError, "dense_blocks must be an int >= 0"),
        ({"keep_sink": "yes"}, TypeError, "keep_sink must be a bool"),
        ({"layout": "BSH"}, ValueError, "layout must be one of"),
    ],
)
def test_estimate_bad_inputs(kw: dict, error: type, message: str) -> None:
    q, k, *_ = _good()
    with pytest.raises(error, match=message):
        estimate_block_mask(q, k, **kw)
