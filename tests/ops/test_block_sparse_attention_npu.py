"""The block-sparse attention op's NPU paths against forward_native.

They run against the kernels of tests/doubles/npu_sparse_attention.py, registered by the
doubles of the legacy ``attentions`` package and of the current ``sgl_kernel_npu`` (each
with its own argument checks), alone or together.
"""

from __future__ import annotations

import logging

import pytest
import torch

import ditops
import tests.doubles.npu_sparse_attention  # noqa: F401 - registers the fake sparse ops
from ditops import config
from ditops.custom_op import BackendUnavailableError
from ditops.ops.block_sparse_attention import (
    ATTENTION_TOLERANCE,
    NPU_FP16_LOGIT_ATOL,
    block_sparse_attention,
)
from ditops.ops.estimate_block_mask import estimate_block_mask
from tests.attention.helpers import random_mask
from tests.doubles.npu_attentions import Recorder, fake_attentions, no_attentions
from tests.doubles.npu_sgl_kernel import (
    fake_sgl_kernel_npu,
    no_sgl_kernel_npu,
    sgl_kernel_npu_without_torch_npu,
)
from tests.ops.test_block_sparse_attention import (
    _poison,
    assert_attention_close,
    assert_same_non_finite,
    bsnd,
    native_attention,
    npu_package,
    qkv,
)


@pytest.mark.parametrize("layout", ["BNSD", "BSND"])
@pytest.mark.parametrize("op_name", ["ada_block_sparse_attention", "block_sparse_attention"])
def test_npu_attention_matches_native(
    on_npu, layout: str, op_name: str, caplog, ditops_warnings
) -> None:
    q, k, v = qkv(4, 2, 300, 32, torch.bfloat16)
    mask, counts = random_mask(1, 4, 3, 3, seed=4)
    args = (q, k, v) if layout == "BNSD" else tuple(bsnd(q, k, v))
    with fake_attentions(ops=[op_name]) as calls, torch.no_grad():
        out = block_sparse_attention(*args, mask.bool(), counts, layout=layout, causal=True)
    want = native_attention(*args, mask, counts, layout=layout, causal=True)
    assert_attention_close(out, want, v)
    assert not ditops_warnings()
    (call,) = calls.of(op_name)
    _, _, _, m, c, lay, size, heads, kv_heads, scale, causal, precise, *_ = call
    assert m.dtype == torch.int8 and c.dtype == torch.int32 and torch.equal(c, counts)
    assert (lay, size, heads, kv_heads, causal, precise) == (layout, 128, 4, 2, True, 0)
    assert scale == pytest.approx(32**-0.5)


@pytest.mark.parametrize("where", ["nan_q_row", "nan_k", "nan_v"])
def test_npu_attention_mends_nan_on_the_device(on_npu, where: str, ditops_warnings) -> None:
    # The NPU kernel runs on poisoned inputs too; NaN lands where the meaning has it. (The
    # double reads values on the host, so no_host_reads is checked on cuda only.)
    q, k, v = _poison(*qkv(4, 2, 1000, 32, torch.bfloat16), where)
    mask, counts = random_mask(1, 4, 8, 8, seed=4, density=1.0)
    with fake_attentions() as calls, torch.no_grad():
        out = block_sparse_attention(q, k, v, mask, counts)
    want = native_attention(q, k, v, mask, counts)
    assert len(calls.of("ada_block_sparse_attention")) == 1 and not ditops_warnings()
    assert bool(want.isnan().any())
    assert_same_non_finite(out, want, v)


def test_npu_attention_prefers_the_new_name(on_npu) -> None:
    q, k, v = qkv(2, 2, 200, 32, torch.float16)
    mask, counts = random_mask(1, 2, 2, 2)
    with fake_attentions() as calls, torch.no_grad():
        block_sparse_attention(q, k, v, mask, counts, scale=0.3)
    assert len(calls.of("ada_block_sparse_attention")) == 1
    assert calls.of("block_sparse_attention") == []


@pytest.mark.parametrize("package", ["legacy", "current"])
def test_npu_attention_fp32_runs_native(on_npu, package: str, ditops_warnings) -> None:
    q, k, v = qkv(2, 2, 200, 32, torch.float32)
    mask, counts = random_mask(1, 2, 2, 2)
    with npu_package(package) as calls, torch.no_grad():
        decision = block_sparse_attention.op.explain_call(q, k, v, mask, counts)
        out = block_sparse_attention(q, k, v, mask, counts)
    assert decision.chosen == "forward_native"
    assert "dtype float32 not supported" in decision.candidates[0].reasons
    assert calls.calls == [] and not ditops_warnings()
    assert torch.equal(out, native_attention(q, k, v, mask, counts))


def test_npu_attention_strict_mode_raises(on_npu) -> None:
    q, k, v = qkv(2, 2, 200, 32, torch.bfloat16)
    mask, counts = random_mask(1, 2, 2, 2)
    with no_attentions(), torch.no_grad(), config.override(strict=True):
        with pytest.raises(BackendUnavailableError, match="attentions"):
            block_sparse_attention(q, k, v, mask, counts)


def attention_call(calls: Recorder) -> dict:
    """The one recorded ada_block_sparse_attention call, by argument name."""
    (args,) = calls.of("ada_block_sparse_attention")
    names = (
        "query key value sparse_mask sparse_count_table input_layout sparse_size num_heads "
        "num_key_value_heads scale_value causal inner_precise pre_tokens next_tokens "
        "actual_seq_lengths actual_seq_lengths_kv"
    ).split()
    return dict(zip(names, args))


def npu_attention_takes() -> str:
    (candidate,) = ditops.explain("block_sparse_attention", ["npu"])[0].candidates
    return candidate.accepts


@pytest.mark.parametrize(("layout", "wrappers"), [("BNSD", True), ("BSND", True), ("BNSD", False)])
def test_npu_current_package_attention_matches_native(
    on_npu, layout: str, wrappers: bool, ditops_warnings
) -> None:
    q, k, v = qkv(4, 2, 300, 32, torch.bfloat16)
    mask, counts = random_mask(1, 4, 3, 3, seed=4)
    args = (q, k, v) if layout == "BNSD" else tuple(bsnd(q, k, v))
    with fake_sgl_kernel_npu(wrappers=wrappers) as calls, torch.no_grad():
        out = block_sparse_attention(*args, mask.bool(), counts, layout=layout, causal=True)
        takes = npu_attention_takes()
    assert_attention_close(
        out, native_attention(*args, mask, counts, layout=layout, causal=True), v
    )
    assert not ditops_warnings()
    call = attention_call(calls)
    assert call["sparse_mask"].dtype == torch.int8 and torch.equal(
        call["sparse_count_table"], counts
    )
    assert (call["input_layout"], call["sparse_size"], call["num_heads"]) == (layout, 128, 4)
    assert (call["num_key_value_heads"], call["causal"], call["inner_precise"]) == (2, True, 0)
    via = (
        "sgl_kernel_npu.attentions.ada_block_sparse_attention -> " if wrappers else ""
    ) + "torch.ops.npu.ada_block_sparse_attention"
    assert f"needs sgl_kernel_npu: {via}" in takes


def peaky_fp16_attention(package: str):
    """fp16 attention whose logits reach about 28 (close to one-hot in places) through
    ``package``'s double: (q, v, output, native output, inner_precise passed)."""
    q, k, v = qkv(2, 2, 256, 64, torch.float32, seed=7)
    q, k, v = (q * 6).half(), k.half(), v.half()
    mask, counts = random_mask(1, 2, 2, 2, density=1.0)
    with npu_package(package) as calls, torch.no_grad():
        out = block_sparse_attention(q, k, v, mask, counts)
    logits = (q.float() @ k.float().transpose(-1, -2)) * 64**-0.5
    want = native_attention(q, k, v, mask, counts)
    return logits, v, out, want, attention_call(calls)["inner_precise"]


def test_npu_fp16_takes_the_high_performance_mode_on_the_current_package(on_npu) -> None:
    # sgl_kernel_npu rejects fp16 with inner_precise 0 or 2: fp16 goes through 1, whose
    # scores and softmax are held in fp16 (the double models it); the bound stated for
    # it in the README covers the error.
    logits, v, out, want, inner_precise = peaky_fp16_attention("current")
    assert inner_precise == 1
    atol, rtol = ATTENTION_TOLERANCE[torch.float16]
    err = (out.float() - want.float()).abs()
    vmax, ref = v.float().abs().max(), want.float().abs()
    # The plain fp16 tolerance does not cover this mode (so the README states its own)...
    assert not bool((err <= atol * vmax + rtol * ref).all())
    # ...the stated one does.
    atol += NPU_FP16_LOGIT_ATOL * float(logits.abs().max())
    assert bool((err <= atol * vmax + rtol * ref).all())


def test_npu_fp16_keeps_high_precision_on_the_legacy_package(on_npu) -> None:
    _, v, out, want, inner_precise = peaky_fp16_attention("legacy")
    assert inner_precise == 0
    assert_attention_close(out, want, v)


def test_npu_current_package_is_preferred_to_the_legacy_one(on_npu) -> None:
    q, k, v = qkv(2, 2, 200, 32, torch.bfloat16)
    mask, counts = random_mask(1, 2, 2, 2)
    with fake_sgl_kernel_npu() as current, fake_attentions() as legacy, torch.no_grad():
        block_sparse_attention(q, k, v, mask, counts)
        # (2 x 2 blocks: in ditops' reading sink and recent are the whole map, no kernel)
        estimate_block_mask(q, k, forced_blocks="on_top")
    assert len(current.of("ada_block_sparse_attention")) == 1
    assert len(current.of("sparse_block_estimate")) == 1
    assert legacy.calls == []


def test_npu_soc_without_the_kernels_uses_the_legacy_package(on_npu, ditops_warnings) -> None:
    # sgl_kernel_npu imports on an A5, but registers no attention kernels there.
    q, k, v = qkv(2, 2, 200, 32, torch.bfloat16)
    mask, counts = random_mask(1, 2, 2, 2)
    with fake_sgl_kernel_npu(ops=[]) as current, fake_attentions() as legacy, torch.no_grad():
        block_sparse_attention(q, k, v, mask, counts)
        takes = npu_attention_takes()
    assert current.calls == [] and len(legacy.of("ada_block_sparse_attention")) == 1
    assert not ditops_warnings()
    assert (
        "needs attentions: torch.ops.attentions.ada_block_sparse_attention "
        "(sgl_kernel_npu: no ada_block_sparse_attention)" in takes
    )


_FALLBACKS = {
    ("legacy", "not_installed"): (no_attentions, "'attentions' package is not installed"),
    ("legacy", "op_missing"): (
        lambda: fake_attentions(ops=["layernorm", "sparse_block_estimate"]),
        "registers no torch.ops.attentions.ada_block_sparse_attention or "
        "torch.ops.attentions.block_sparse_attention",
    ),
    ("legacy", "raises"): (
        lambda: fake_attentions(raising={"ada_block_sparse_attention"}),
        "fake attentions.ada_block_sparse_attention failed at run time",
    ),
    ("current", "not_installed"): (no_sgl_kernel_npu, "sgl_kernel_npu is not installed"),
    ("current", "no_torch_npu"): (
        sgl_kernel_npu_without_torch_npu,
        "sgl_kernel_npu failed to import (No module named 'torch_npu')",
    ),
    ("current", "op_missing"): (
        lambda: fake_sgl_kernel_npu(ops=["sparse_block_estimate"]),
        "sgl_kernel_npu is installed but registers no torch.ops.npu.ada_block_sparse_attention: "
        "its attention kernels are built only for Ascend910B (A2) and Ascend910_93 (A3) SoCs",
    ),
    ("current", "raises"): (
        lambda: fake_sgl_kernel_npu(raising={"ada_block_sparse_attention"}),
        "fake npu.ada_block_sparse_attention failed at run time",
    ),
}


@pytest.mark.parametrize(("package", "case"), sorted(_FALLBACKS))
def test_npu_attention_fallbacks_warn_once(
    on_npu, package: str, case: str, caplog, ditops_warnings
) -> None:
    # The other package is not installed throughout (conftest's on_npu).
    setup, expected = _FALLBACKS[(package, case)]
    q, k, v = qkv(2, 2, 200, 32, torch.bfloat16)
    mask, counts = random_mask(1, 2, 2, 2)
    want = native_attention(q, k, v, mask, counts)
    with setup(), torch.no_grad(), caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert torch.equal(block_sparse_attention(q, k, v, mask, counts), want)
        reasons = ditops.explain("block_sparse_attention", ["npu"])[0].candidates[0].reasons
    warnings = ditops_warnings()
    assert len(warnings) == 1 and expected in warnings[0], warnings
    assert any(expected in r for r in reasons), reasons
    if case != "raises":  # neither package has it: both are named, the hint is the current one
        other = "sgl_kernel_npu is not installed" if package == "legacy" else "the legacy"
        assert other in warnings[0] and "install the sgl_kernel_npu wheel" in warnings[0]


_INELIGIBLE = {
    "block_size_64": ({"block_size": 64}, 2, 1, 32, 32, "block_size 64: the NPU kernels take"),
    "block_size_640": ({"block_size": 640}, 2, 1, 32, 32, "in [128, 512]"),
    "head_dim_576": ({}, 1, 1, 576, 576, "head dim 576: the NPU kernel takes at most 512"),
    "heads_264": ({}, 264, 264, 8, 8, "264 query heads: the NPU kernel takes at most 256"),
    "v_head_dim": ({}, 1, 1, 32, 16, "v's head dim 16 differs from q's 32"),
}


@pytest.mark.parametrize("package", ["legacy", "current"])
@pytest.mark.parametrize("case", sorted(_INELIGIBLE))
def test_npu_attention_ineligible_calls_run_native(
    on_npu, package: str, case: str, ditops_warnings
) -> None:
    kw, heads, kv_heads, dim, v_dim, reason = _INELIGIBLE[case]
    block = kw.get("block_size", 128)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, heads, 130, dim, generator=gen).bfloat16()
    k = torch.randn(1, kv_heads, 130, dim, generator=gen).bfloat16()
    v = torch.randn(1, kv_heads, 130, v_dim, generator=gen).bfloat16()
    blocks = -(-130 // block)
    mask, counts = random_mask(1, heads, blocks, blocks)
    with npu_package(package) as calls, torch.no_grad():
        decision = block_sparse_attention.op.explain_call(
            q, k, v, mask, counts, layout="BNSD", scale=None, causal=False, block_size=block
        )
        out = block_sparse_attention(q, k, v, mask, counts, **kw)
        # an eligible call afterwards still takes the kernel: nothing was given up
        q2, k2, v2 = qkv(1, 1, 200, 16, torch.bfloat16)
        m2, c2 = random_mask(1, 1, 2, 2)
        block_sparse_attention(q2, k2, v2, m2, c2)
    assert decision.chosen == "forward_native"
    assert any(reason in r for r in decision.candidates[0].reasons), decision
    assert torch.equal(out, native_attention(q, k, v, mask, counts, **kw))
    assert len(calls.of("ada_block_sparse_attention")) == 1 and not ditops_warnings()
