"""Block-sparse attention ops and layer: every path against forward_native.

The ``cpu`` path (gathered keys + SDPA, no compile) is tested in depth in
tests/kernels/test_cpu_block_sparse_attention.py; here it runs next to the ``cuda``
path, which runs FlexAttention on CPU tensors under ``force_device_kind({"cpu":
"cuda"})``. FlexAttention compiles once per shape (~15 s on 2 cores), so the cuda tests
share two compiled shapes: ``SHAPE_A`` (fp32, GQA 4/2, 1000 tokens, not causal: the
video path, with the element mask skipped) and ``SHAPE_B`` (bf16, GQA 2/1, 4097 tokens,
causal). The NPU paths run against the kernels of
tests/doubles/npu_sparse_attention.py, registered by the doubles of the legacy
``attentions`` package and of the current ``sgl_kernel_npu`` (each with its own argument
checks), alone or together.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
import torch.nn.functional as F

import ditops
import ditops.ops.block_sparse_attention as bsa_op
import tests.doubles.npu_sparse_attention  # noqa: F401 - registers the fake sparse ops
from ditops import config
from ditops.attention import BlockSparseConfig
from ditops.attention.estimate import estimate_block_mask_reference
from ditops.custom_op import BackendUnavailableError
from ditops.layers.sparse_attention import BlockSparseAttention, dense_attention
from ditops.ops.attention_npu import block_size_reasons, npu_in_budget_ratio
from ditops.ops.block_sparse_attention import (
    ATTENTION_TOLERANCE,
    NPU_FP16_LOGIT_ATOL,
    BlockSparseAttentionOp,
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


def npu_package(package: str) -> contextlib.AbstractContextManager[Recorder]:
    """The double of the legacy ``attentions`` package or of the current ``sgl_kernel_npu``."""
    return fake_attentions() if package == "legacy" else fake_sgl_kernel_npu()


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
        return block_sparse_attention.op.forward_native(
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
        chosen = block_sparse_attention.op.explain_call(q, k, v, mask, counts).chosen
    assert chosen == f"forward_{kind}"
    assert_attention_close(out, want, v)
    assert bool((out[:, :, :128] == 0).all())
    assert out_bsnd.is_contiguous()
    assert_attention_close(out_bsnd.transpose(1, 2), want, v)
    assert not ditops_warnings()


def _poison(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, where: str):
    q, k, v = q.clone(), k.clone(), v.clone()
    if where == "nan_q_row":
        q[0, 1, 300] = float("nan")  # one query row
    elif where == "inf_k":
        k[0, 1, 700, 3] = float("inf")
    elif where == "nan_k":
        k[0, 1, 700, 3] = float("nan")
    elif where == "nan_v":
        v[0, 0, 5, 0] = float("nan")
    return q, k, v


def assert_same_non_finite(out: torch.Tensor, want: torch.Tensor, v: torch.Tensor) -> None:
    """NaN/inf exactly where the meaning has them; the rest within the fast tolerance
    (a compiled graph runs the meaning through inductor, not bit for bit)."""
    assert torch.equal(out.isnan(), want.isnan()) and torch.equal(out.isinf(), want.isinf())
    finite = want.isfinite()
    assert bool(finite.any())
    scale_v = torch.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0)
    assert_attention_close(out.masked_fill(~finite, 0), want.masked_fill(~finite, 0), scale_v)


@pytest.mark.parametrize("where", ["nan_q_row", "inf_k", "nan_v"])
def test_nan_and_inf_propagate_as_in_the_meaning(where: str) -> None:
    # Regression: FlexAttention turned a NaN query row into zeros (the meaning and dense
    # SDPA give NaN) and ignored an inf key. On CPU such a call runs the meaning.
    q, k, v = _poison(*qkv(**SHAPE_A), where)
    mask, counts = random_mask(1, 4, 8, 8, seed=1, density=1.0)
    want = native_attention(q, k, v, mask, counts)
    assert bool(want.isnan().any())
    with torch.no_grad():
        out = block_sparse_attention(q, k, v, mask, counts)
        decision = block_sparse_attention.op.explain_call(q, k, v, mask, counts)
    assert decision.chosen == "forward_native"
    gathered = next(c for c in decision.candidates if c.path == "forward_cpu")
    assert any("NaN or inf" in r for r in gathered.reasons)
    assert_same_non_finite(out, want, v)


@contextlib.contextmanager
def no_host_reads(monkeypatch: pytest.MonkeyPatch):
    """Reading a tensor's value back to Python raises (on a GPU: a stall)."""

    def refuse(*_a, **_kw):
        raise AssertionError("a tensor value was read back to the host")

    with monkeypatch.context() as mp:
        for name in ("__bool__", "item", "tolist"):
            mp.setattr(torch.Tensor, name, refuse)
        yield


def _blind_cuda_path(monkeypatch: pytest.MonkeyPatch, blind: bool) -> None:
    """``blind``: the cuda path returns the clean inputs' result, as a kernel that drops
    every NaN/inf would; else FlexAttention (on CPU tensors) runs."""
    if not blind:
        return

    def clean_result(self, c):
        clean = [torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0) for t in (c.q, c.k, c.v)]
        opts = {
            "layout": c.layout,
            "scale": c.scale,
            "causal": c.causal,
            "block_size": c.block_size,
        }
        return BlockSparseAttentionOp.forward_native(self, *clean, c.mask, c.counts, **opts)

    monkeypatch.setattr(BlockSparseAttentionOp, "forward_cuda", clean_result)


@pytest.mark.parametrize("blind", [True, False])
@pytest.mark.parametrize(
    "where, density",
    [("nan_q_row", 1.0), ("nan_q_row", 0.5), ("nan_k", 1.0), ("nan_k", 0.5), ("nan_v", 1.0)],
)
def test_nan_is_mended_on_the_device_as_in_the_meaning(
    monkeypatch: pytest.MonkeyPatch, where: str, density: float, blind: bool
) -> None:
    # An accelerator's call reads nothing back: the path runs and NaN is put, on the
    # device, where the meaning has it (a NaN v spreads, in the meaning, to every row of
    # its heads: with a sparse mask the mend follows the mask, so v is tested dense).
    q, k, v = _poison(*qkv(**SHAPE_A), where)
    mask, counts = random_mask(1, 4, 8, 8, seed=1, density=density)
    want = native_attention(q, k, v, mask, counts)
    assert bool(want.isnan().any()) and bool(want.isfinite().any())
    _blind_cuda_path(monkeypatch, blind)
    with ditops.force_device_kind({"cpu": "cuda"}), torch.no_grad():
        decision = block_sparse_attention.op.explain_call(q, k, v, mask, counts)
        with no_host_reads(monkeypatch):
            out = block_sparse_attention(q, k, v, mask, counts)
            out_bsnd = block_sparse_attention(*bsnd(q, k, v), mask, counts, layout="BSND")
    assert decision.chosen == "forward_cuda"
    assert_same_non_finite(out, want, v)
    assert_same_non_finite(out_bsnd.transpose(1, 2), want, v)
    assert out_bsnd.is_contiguous()


@pytest.mark.parametrize("blind", [True, False])
def test_inf_is_mended_loudly_on_the_device(monkeypatch: pytest.MonkeyPatch, blind: bool) -> None:
    # inf: NaN wherever the meaning is non-finite, and also where it stays finite (a key
    # whose score is -inf only drops out of the meaning's softmax): loud, never silent.
    q, k, v = _poison(*qkv(**SHAPE_A), "inf_k")
    mask, counts = random_mask(1, 4, 8, 8, seed=1)
    want = native_attention(q, k, v, mask, counts)
    _blind_cuda_path(monkeypatch, blind)
    with ditops.force_device_kind({"cpu": "cuda"}), torch.no_grad(), no_host_reads(monkeypatch):
        out = block_sparse_attention(q, k, v, mask, counts)
    assert not bool((~want.isfinite() & out.isfinite()).any())
    assert bool((~out.isfinite() & want.isfinite()).any())  # the loud part


def test_nan_propagates_inside_a_compiled_graph() -> None:
    q, k, v = _poison(*qkv(**SHAPE_A), "nan_q_row")
    mask, counts = random_mask(1, 4, 8, 8, seed=1)

    @torch.compile(fullgraph=True)
    def attend(q, k, v, mask, counts):
        return block_sparse_attention(q, k, v, mask, counts)

    with torch.no_grad():
        poisoned = attend(q, k, v, mask, counts)
        clean_q = torch.nan_to_num(q)
        clean = attend(clean_q, k, v, mask, counts)
    assert_same_non_finite(poisoned, native_attention(q, k, v, mask, counts), v)
    assert_attention_close(clean, native_attention(clean_q, k, v, mask, counts), v)


@pytest.mark.parametrize("kind", ["cpu", "cpu_flex", "cuda"])
def test_causal_bf16_odd_length(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = qkv(**SHAPE_B)  # 4097 tokens: long enough for the CPU FlexAttention path
    mask, counts = random_mask(1, 2, 33, 33, seed=2)
    if kind == "cpu":  # the gathered path, whatever this CPU has
        monkeypatch.setattr(bsa_op, "CPU_FLEX_MIN_TOKENS", 10**9)
    if kind == "cpu_flex":  # taken with AMX tiles; the same code runs (slower) without
        monkeypatch.setattr(bsa_op, "amx_tiles", lambda: True)
    forced = ditops.force_device_kind({"cpu": kind}) if kind == "cuda" else contextlib.nullcontext()
    with forced, torch.no_grad():
        out = block_sparse_attention(q, k, v, mask, counts, causal=True)
        assert block_sparse_attention.op.explain_call(q, k, v, mask, counts).chosen == (
            f"forward_{kind}"
        )
    want = native_attention(q, k, v, mask, counts, causal=True)
    assert_attention_close(out, want, v)


def test_exact_precision_runs_native() -> None:
    q, k, v = qkv(2, 2, 300, 16, torch.float32)
    mask, counts = random_mask(1, 2, 3, 3)
    with torch.no_grad(), config.override(precision="exact"):
        out = block_sparse_attention(q, k, v, mask, counts)
        assert block_sparse_attention.op.explain_call(q, k, v, mask, counts).chosen == (
            "forward_native"
        )
    assert torch.equal(out, native_attention(q, k, v, mask, counts))


def test_gradients_take_the_native_path() -> None:
    q, k, v = qkv(2, 2, 300, 16, torch.float32)
    q.requires_grad_(True)
    mask, counts = random_mask(1, 2, 3, 3, density=1.0)
    decision = block_sparse_attention.op.explain_call(q, k, v, mask, counts)
    assert decision.chosen == "forward_native"
    gathered = next(c for c in decision.candidates if c.path == "forward_cpu")
    assert "grad enabled" in gathered.reasons[0]
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


# --- npu: the current sgl_kernel_npu (torch.ops.npu), and how the two packages combine -----


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
    "block_size": 128, "stride": 16, "scale": 0.25, "threshold": 0.9, "keep_ratio": 0.3,
    "keep_sink": True, "keep_recent": False, "dense_blocks": 2, "forced_blocks": "on_top",
}  # fmt: skip


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
        layout, 16, 128, 4, 2, pytest.approx(0.25 / 16), pytest.approx(0.9), causal, True, False,
        pytest.approx(0.3),
    )  # fmt: skip


@pytest.mark.parametrize("package", ["legacy", "current"])
@pytest.mark.parametrize(("causal", "threshold"), [(False, 1.0), (True, 1.0), (False, 0.9)])
def test_npu_estimate_in_budget_holds_the_meanings_blocks(
    on_npu, package: str, causal: bool, threshold: float
) -> None:
    """ditops' reading on the NPU: the kernel's per-row top-k, asked for the largest row
    budget plus the first frame's columns, keeps every block the meaning keeps."""
    q, k = integer_qk(4, 2, 1500)  # 12 x 12 blocks
    dense = 2 if threshold == 1.0 else 0  # threshold < 1 with a first frame runs native
    kw = {"block_size": 128, "stride": 16, "scale": 0.25, "threshold": threshold,
          "keep_ratio": 0.6, "keep_sink": True, "keep_recent": True, "dense_blocks": dense,
          "causal": causal}  # fmt: skip
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


def test_empty_sequences_give_empty_or_zero_outputs() -> None:
    q, k, v = qkv(2, 2, 0, 16, torch.float32)
    mask, counts = (
        torch.zeros(1, 2, 0, 0, dtype=torch.int8),
        torch.zeros(1, 2, 0, dtype=torch.int32),
    )
    with torch.no_grad():
        assert block_sparse_attention(q, k, v, mask, counts).shape == (1, 2, 0, 16)
        decision = block_sparse_attention.op.explain_call(q, k, v, mask, counts)
        m, c = estimate_block_mask(q, k)
    assert decision.chosen == "forward_native"
    assert all(any("empty" in r for r in c.reasons) for c in decision.candidates)
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
