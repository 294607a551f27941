"""Block-sparse attention ops and layer: every path against forward_native.

The ``cpu`` path (gathered keys + SDPA, no compile) is tested in depth in
tests/kernels/test_cpu_block_sparse_attention.py; here it runs next to the ``cuda``
path, which runs FlexAttention on CPU tensors under ``force_device_kind({"cpu":
"cuda"})``. FlexAttention compiles once per shape (~15 s on 2 cores), so the cuda tests
share two compiled shapes: ``SHAPE_A`` (fp32, GQA 4/2, 1000 tokens, not causal: the
video path, with the element mask skipped) and ``SHAPE_B`` (bf16, GQA 2/1, 4097 tokens,
causal). The NPU paths run against the test double in
tests/doubles/npu_sparse_attention.py.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
import torch.nn.functional as F

import ditops
import tests.doubles.npu_sparse_attention  # noqa: F401 - registers the fake sparse ops
from ditops import config
from ditops.attention import BlockSparseConfig
from ditops.attention.estimate import estimate_block_mask_reference
from ditops.custom_op import BackendUnavailableError
from ditops.layers.attention import (
    ATTENTION_TOLERANCE,
    BlockSparseAttention,
    block_sparse_attention,
    dense_attention,
    estimate_block_mask,
)
from tests.attention.helpers import random_mask
from tests.doubles.npu_attentions import fake_attentions, no_attentions

SHAPE_A = {"heads": 4, "kv_heads": 2, "seq": 1000, "dim": 64, "dtype": torch.float32}
SHAPE_B = {"heads": 2, "kv_heads": 1, "seq": 4097, "dim": 32, "dtype": torch.bfloat16}


def qkv(heads: int, kv_heads: int, seq: int, dim: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, seq, dim, generator=gen).to(dtype)
    k = torch.randn(1, kv_heads, seq, dim, generator=gen).to(dtype)
    v = torch.randn(1, kv_heads, seq, dim, generator=gen).to(dtype)
    return q, k, v


def bsnd(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.transpose(1, 2).contiguous() for t in ts]


def native_attention(q, k, v, mask, counts, **kw) -> torch.Tensor:
    with torch.no_grad():
        return block_sparse_attention.forward_native(
            q, k, v, mask, counts, **{"layout": "BNSD", "scale": None, "causal": False,
                                      "block_size": 128, **kw}
        )  # fmt: skip


def assert_attention_close(out: torch.Tensor, ref: torch.Tensor, v: torch.Tensor) -> None:
    """The op's documented ``fast`` tolerance."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    atol, rtol = ATTENTION_TOLERANCE[ref.dtype]
    err = (out.float() - ref.float()).abs()
    bound = atol * v.float().abs().max() + rtol * ref.float().abs()
    assert bool((err <= bound).all()), f"max error {err.max()}, bound {bound.min()}"


# --- cpu (gathered SDPA) and cuda (compiled FlexAttention) -------------------------------


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_cpu_and_cuda_paths_match_native(
    kind: str, caplog: pytest.LogCaptureFixture, ditops_warnings
) -> None:
    q, k, v = qkv(**SHAPE_A)
    mask, counts = random_mask(1, 4, 8, 8, seed=1)  # empty row 0, full row 7
    want = native_attention(q, k, v, mask, counts)
    forced = ditops.force_device_kind({"cpu": kind}) if kind != "cpu" else contextlib.nullcontext()
    with forced, torch.no_grad():
        out = block_sparse_attention(q, k, v, mask, counts)
        # BSND: for FlexAttention the same compiled shape (made contiguous BNSD inside).
        out_bsnd = block_sparse_attention(*bsnd(q, k, v), mask, counts, layout="BSND")
        chosen = block_sparse_attention.explain_call(q, k, v, mask, counts).chosen
    assert chosen == f"forward_{kind}"
    assert_attention_close(out, want, v)
    assert bool((out[:, :, :128] == 0).all())
    assert out_bsnd.is_contiguous()
    assert_attention_close(out_bsnd.transpose(1, 2), want, v)
    assert not ditops_warnings()


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_causal_bf16_odd_length(kind: str) -> None:
    q, k, v = qkv(**SHAPE_B)
    mask, counts = random_mask(1, 2, 33, 33, seed=2)
    forced = ditops.force_device_kind({"cpu": kind}) if kind != "cpu" else contextlib.nullcontext()
    with forced, torch.no_grad():
        out = block_sparse_attention(q, k, v, mask, counts, causal=True)
        assert block_sparse_attention.explain_call(q, k, v, mask, counts).chosen == (
            f"forward_{kind}"
        )
    want = native_attention(q, k, v, mask, counts, causal=True)
    assert_attention_close(out, want, v)


def test_exact_precision_runs_native() -> None:
    q, k, v = qkv(2, 2, 300, 16, torch.float32)
    mask, counts = random_mask(1, 2, 3, 3)
    with torch.no_grad(), config.override(precision="exact"):
        out = block_sparse_attention(q, k, v, mask, counts)
        assert block_sparse_attention.explain_call(q, k, v, mask, counts).chosen == (
            "forward_native"
        )
    assert torch.equal(out, native_attention(q, k, v, mask, counts))


def test_gradients_take_the_native_path() -> None:
    q, k, v = qkv(2, 2, 300, 16, torch.float32)
    q.requires_grad_(True)
    mask, counts = random_mask(1, 2, 3, 3, density=1.0)
    decision = block_sparse_attention.explain_call(q, k, v, mask, counts)
    assert decision.chosen == "forward_native"
    assert "grad enabled" in decision.candidates[0].reasons[0]
    block_sparse_attention(q, k, v, mask, counts).sum().backward()
    assert q.grad is not None and bool(q.grad.isfinite().all())


# --- npu: the attentions operators, through the test double ----------------------------


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


def test_npu_attention_prefers_the_new_name(on_npu) -> None:
    q, k, v = qkv(2, 2, 200, 32, torch.float16)
    mask, counts = random_mask(1, 2, 2, 2)
    with fake_attentions() as calls, torch.no_grad():
        block_sparse_attention(q, k, v, mask, counts, scale=0.3)
    assert len(calls.of("ada_block_sparse_attention")) == 1
    assert calls.of("block_sparse_attention") == []


def test_npu_attention_fp32_runs_native(on_npu) -> None:
    q, k, v = qkv(2, 2, 200, 32, torch.float32)
    mask, counts = random_mask(1, 2, 2, 2)
    with fake_attentions() as calls, torch.no_grad():
        out = block_sparse_attention(q, k, v, mask, counts)
    assert calls.calls == []
    assert torch.equal(out, native_attention(q, k, v, mask, counts))


@pytest.mark.parametrize("case", ["not_installed", "op_missing", "raises"])
def test_npu_attention_fallbacks_warn_once(on_npu, case: str, caplog, ditops_warnings) -> None:
    q, k, v = qkv(2, 2, 200, 32, torch.bfloat16)
    mask, counts = random_mask(1, 2, 2, 2)
    setups = {
        "not_installed": no_attentions,
        "op_missing": lambda: fake_attentions(ops=["layernorm", "sparse_block_estimate"]),
        "raises": lambda: fake_attentions(raising={"ada_block_sparse_attention"}),
    }
    expected = {
        "not_installed": "'attentions' package is not installed",
        "op_missing": "registers no torch.ops.attentions.ada_block_sparse_attention or "
        "torch.ops.attentions.block_sparse_attention",
        "raises": "fake attentions.ada_block_sparse_attention failed at run time",
    }[case]
    want = native_attention(q, k, v, mask, counts)
    with setups[case](), torch.no_grad(), caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert torch.equal(block_sparse_attention(q, k, v, mask, counts), want)
    warnings = ditops_warnings()
    assert len(warnings) == 1 and expected in warnings[0], warnings


def test_npu_attention_strict_mode_raises(on_npu) -> None:
    q, k, v = qkv(2, 2, 200, 32, torch.bfloat16)
    mask, counts = random_mask(1, 2, 2, 2)
    with no_attentions(), torch.no_grad(), config.override(strict=True):
        with pytest.raises(BackendUnavailableError, match="attentions"):
            block_sparse_attention(q, k, v, mask, counts)


def integer_qk(heads: int, kv_heads: int, seq: int, dtype: torch.dtype = torch.bfloat16):
    """Scores exact in every dtype: the NPU double and native pick the same blocks."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randint(-1, 2, (1, heads, seq, 16), generator=gen).float()
    k = torch.randint(-1, 2, (1, kv_heads, seq, 16), generator=gen).float()
    k[..., 0] = torch.randint(-3, 4, (1, kv_heads, seq), generator=gen).float()
    q[..., 0] = 1.0
    return q.to(dtype), k.to(dtype)


@pytest.mark.parametrize("layout", ["BNSD", "BSND"])
@pytest.mark.parametrize("causal", [False, True])
def test_npu_estimate_matches_native(on_npu, layout: str, causal: bool) -> None:
    q, k = integer_qk(4, 2, 1000)
    if layout == "BSND":
        q, k = bsnd(q, k)
    kw = {
        "layout": layout, "block_size": 32, "stride": 4, "scale": 0.25, "threshold": 0.9,
        "keep_ratio": 0.3, "keep_sink": True, "keep_recent": False, "causal": causal,
        "dense_blocks": 2,
    }  # fmt: skip
    with fake_attentions() as calls, torch.no_grad():
        mask, counts = estimate_block_mask(q, k, **kw)
    # The double computes in fp32 from the (exactly representable) bf16 inputs.
    want_mask, want_counts = estimate_block_mask_reference(q.float(), k.float(), **kw)
    assert mask.shape == (1, 4, 32, 32) and mask.is_contiguous()
    assert torch.equal(mask, want_mask) and torch.equal(counts, want_counts)
    assert bool(mask[..., :2, :].all()) if not causal else bool(mask[..., :, :2].any())
    (call,) = calls.of("sparse_block_estimate")
    assert call[4:] == (
        layout, 4, 32, 4, 2, pytest.approx(0.25 / 4), pytest.approx(0.9), causal, True, False,
        pytest.approx(0.3),
    )  # fmt: skip


def test_npu_estimate_cross_attention_runs_native(on_npu) -> None:
    q, _ = integer_qk(2, 2, 512)
    _, k = integer_qk(2, 2, 256)
    with fake_attentions() as calls, torch.no_grad():
        decision = estimate_block_mask.explain_call(q, k, layout="BNSD")
        mask, _ = estimate_block_mask(q, k, block_size=32, stride=4)
    assert decision.chosen == "forward_native"
    assert "assumes self-attention" in decision.candidates[0].reasons[0]
    assert calls.calls == [] and mask.shape == (1, 2, 16, 8)


def test_npu_estimate_missing_op_falls_back(on_npu, caplog, ditops_warnings) -> None:
    q, k = integer_qk(2, 2, 300)
    with fake_attentions(ops=["ada_block_sparse_attention"]), torch.no_grad():
        with caplog.at_level(logging.WARNING):
            mask, counts = estimate_block_mask(q, k, keep_ratio=0.5, block_size=32, stride=4)
    want = estimate_block_mask_reference(q, k, keep_ratio=0.5, block_size=32, stride=4)
    assert torch.equal(mask, want[0]) and torch.equal(counts, want[1])
    (warning,) = ditops_warnings()
    assert "torch.ops.attentions.sparse_block_estimate" in warning


# --- bad inputs --------------------------------------------------------------------------


def _good():
    q, k, v = qkv(2, 1, 300, 16, torch.float32)
    mask, counts = random_mask(1, 2, 3, 3)
    return q, k, v, mask, counts


@pytest.mark.parametrize(
    ("case", "error", "message"),
    [
        ("int_q", TypeError, "q dtype torch.int64 not supported"),
        ("mixed_dtype", TypeError, "k dtype torch.float16 differs from q"),
        ("q_3d", ValueError, "q must be 4-D"),
        ("layout", ValueError, "layout must be one of"),
        ("heads", ValueError, r"query heads \(3\) must be a multiple of key heads \(2\)"),
        ("head_dim", ValueError, "head dims differ"),
        ("kv_len", ValueError, "k and v must agree"),
        ("mask_shape", ValueError, r"mask shape must be \[B, N, Qb, >=KVb\]"),
        ("counts", ValueError, "counts must equal the row sums"),
        ("mask_device", ValueError, "mask is on meta, q on cpu"),
        ("block_size", ValueError, "block_size must be a positive int"),
        ("scale", ValueError, "scale must be None or a positive number"),
        ("causal", TypeError, "causal must be a bool"),
    ],
)
def test_attention_bad_inputs(case: str, error: type, message: str) -> None:
    q, k, v, mask, counts = _good()
    kw: dict = {}
    if case == "int_q":
        q = q.long()
    elif case == "mixed_dtype":
        k = k.half()
    elif case == "q_3d":
        q = q[0]
    elif case == "layout":
        kw["layout"] = "TND"
    elif case == "heads":
        q = torch.randn(1, 3, 300, 16)
        k, v = torch.randn(1, 2, 300, 16), torch.randn(1, 2, 300, 16)
    elif case == "head_dim":
        k = torch.randn(1, 1, 300, 8)
    elif case == "kv_len":
        v = torch.randn(1, 1, 200, 16)
    elif case == "mask_shape":
        mask = mask[:, :1]
    elif case == "counts":
        counts = counts + 1
    elif case == "mask_device":
        mask = mask.to("meta")
    elif case == "block_size":
        kw["block_size"] = 0
    elif case == "scale":
        kw["scale"] = -1.0
    elif case == "causal":
        kw["causal"] = 1
    with pytest.raises(error, match=message):
        block_sparse_attention(q, k, v, mask, counts, **kw)


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


# --- the layer and its schedule ----------------------------------------------------------


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
            q, k, block_size=32, stride=4, keep_ratio=0.25, dense_blocks=2
        )
        want = native_attention(q, k, v, mask, counts, block_size=32)
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
        mask, counts = estimate_block_mask(q, k, keep_ratio=0.5)
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


def test_empty_sequences_give_empty_or_zero_outputs() -> None:
    q, k, v = qkv(2, 2, 0, 16, torch.float32)
    mask, counts = (
        torch.zeros(1, 2, 0, 0, dtype=torch.int8),
        torch.zeros(1, 2, 0, dtype=torch.int32),
    )
    with torch.no_grad():
        assert block_sparse_attention(q, k, v, mask, counts).shape == (1, 2, 0, 16)
        decision = block_sparse_attention.explain_call(q, k, v, mask, counts)
        m, c = estimate_block_mask(q, k)
    assert decision.chosen == "forward_native" and "empty" in decision.candidates[0].reasons[0]
    assert m.shape == (1, 2, 0, 0) and c.shape == (1, 2, 0)
    # Queries but no keys: zeros, and an all-zero mask from the estimator.
    q = torch.randn(1, 2, 130, 16)
    k = v = torch.randn(1, 2, 0, 16)
    mask, counts = (
        torch.zeros(1, 2, 2, 0, dtype=torch.int8),
        torch.zeros(1, 2, 2, dtype=torch.int32),
    )
    with torch.no_grad():
        out = block_sparse_attention(q, k, v, mask, counts)
        m, c = estimate_block_mask(q, k)
    assert out.shape == (1, 2, 130, 16) and bool((out == 0).all())
    assert m.shape == (1, 2, 2, 0) and bool((c == 0).all())
