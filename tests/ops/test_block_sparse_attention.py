"""The block-sparse attention op: every path against forward_native.

The ``cpu`` path (gathered keys + SDPA, no compile) is tested in depth in
tests/kernels/test_cpu_block_sparse_attention.py; here it runs next to the ``cuda``
path, which runs FlexAttention on CPU tensors under ``force_device_kind({"cpu":
"cuda"})``. FlexAttention compiles once per shape (~15 s on 2 cores), so the cuda tests
share two compiled shapes: ``SHAPE_A`` (fp32, GQA 4/2, 1000 tokens, not causal: the
video path, with the element mask skipped) and ``SHAPE_B`` (bf16, GQA 2/1, 4097 tokens,
causal). The NPU paths: tests/ops/test_block_sparse_attention_npu.py.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import ditops
import ditops.ops.block_sparse_attention as bsa_op
import tests.doubles.npu_sparse_attention  # noqa: F401 - registers the fake sparse ops
from ditops import config
from ditops.ops.block_sparse_attention import (
    ATTENTION_TOLERANCE,
    BlockSparseAttentionOp,
    block_sparse_attention,
)
from ditops.ops.estimate_block_mask import estimate_block_mask
from tests.attention.helpers import random_mask
from tests.doubles.npu_attentions import Recorder, fake_attentions
from tests.doubles.npu_sgl_kernel import (
    fake_sgl_kernel_npu,
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
            q,
            k,
            v,
            mask,
            counts,
            **{"layout": "BNSD", "scale": None, "causal": False, "block_size": 128, **kw},
        )


def assert_attention_close(out: torch.Tensor, ref: torch.Tensor, v: torch.Tensor) -> None:
    """The op's documented ``fast`` tolerance."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    atol, rtol = ATTENTION_TOLERANCE[ref.dtype]
    err = (out.float() - ref.float()).abs()
    bound = atol * v.float().abs().max() + rtol * ref.float().abs()
    assert bool((err <= bound).all()), f"max error {err.max()}, bound {bound.min()}"


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
