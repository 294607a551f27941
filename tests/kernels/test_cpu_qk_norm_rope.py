"""The CPU prologue kernels, walked in blocks of a few rows, against the ops' meanings.

Blocks are made 3 tokens long (``small_blocks``; q and k share a block), so every
test crosses blocks, batch boundaries and a ragged last block; inputs come strided (a
slice of a fused q|k|v projection), tables per sample or shared, full width with or
without equal pair members, fp32 or low precision. Exact mode must give the meaning's bits in every
combination; fast mode is held to the fused op's tolerance.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from ditops.kernels import qk_norm_rope_tables as rope_tables
from ditops.kernels.cpu import qk_norm_rope as K
from ditops.ops.qk_norm_rope import qk_norm_rope, rms_norm, rotary_embedding
from tests.precision import assert_exact, assert_fast, assert_fast_pairs

B, L, H, D = 2, 10, 3, 8
EPS = 1e-6
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    # 3 tokens of q and k per block (6 of one tensor alone): L = 10 ends raggedly
    monkeypatch.setattr(K, "_BLOCK_BYTES", 4 * H * D * 2 * 3)


def _strided(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k as chunks of one fused projection: row stride 3 * H * D."""
    qkv = (torch.randn(B, L, 3 * H * D) * 2).to(dtype)
    q, k, _ = qkv.chunk(3, dim=-1)
    return q.unflatten(2, (H, D)), k.unflatten(2, (H, D))


def _tables(kind: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    ang = torch.rand(B, L, 1, D // 2) * 6.3
    c, s = ang.cos(), ang.sin()
    if kind == "pair":  # one angle per pair, per sample
        return c.to(dtype), s.to(dtype)
    if kind == "shared_full":  # [L, D], members repeated (as diffusers builds them)
        return c[0, :, 0].repeat_interleave(2, -1).to(dtype), s[0, :, 0].repeat_interleave(
            2, -1
        ).to(dtype)
    # full width, members differing: read element by element
    return torch.randn(1, L, 1, D).to(dtype), torch.randn(1, L, 1, D).to(dtype)


COMBOS = list(
    itertools.product(
        [BF16, FP16, FP32],  # activations
        ["torch", "diffusers"],
        [False, True],  # across heads
        ["interleaved", "halves"],
        ["pair", "shared_full", "unequal"],
    )
)


@pytest.mark.parametrize(("dtype", "convention", "across", "layout", "tables"), COMBOS)
def test_exact_fused_is_the_meaning(
    small_blocks: None, dtype: torch.dtype, convention: str, across: bool, layout: str, tables: str
) -> None:
    torch.manual_seed(0)
    q, k = _strided(dtype)
    n = H * D if across else D
    for w_dtype, t_dtype in ((dtype, FP32), (FP32, dtype)):
        wq, wk = (torch.randn(n) * 0.5 + 1).to(w_dtype), (torch.randn(n) * 0.5 + 1).to(w_dtype)
        cos, sin = _tables(tables, t_dtype)
        args = (q, k, wq, wk, cos, sin, EPS)
        want = qk_norm_rope.op.forward_native(
            *args, across_heads=across, layout=layout, convention=convention
        )
        qk_norm_rope.op.precision = "exact"
        try:
            with torch.inference_mode():
                got = qk_norm_rope(*args, across_heads=across, layout=layout, convention=convention)
        finally:
            qk_norm_rope.op.precision = None
        assert_exact(got[0], want[0])
        assert_exact(got[1], want[1])


@pytest.mark.parametrize("convention", ["torch", "diffusers"])
@pytest.mark.parametrize("across", [False, True])
@pytest.mark.parametrize("layout", ["interleaved", "halves"])
def test_fast_fused_within_tolerance(
    small_blocks: None, convention: str, across: bool, layout: str
) -> None:
    torch.manual_seed(0)
    q, k = _strided(BF16)
    n = H * D if across else D
    wq, wk = (torch.randn(n) * 0.5 + 1).bfloat16(), (torch.randn(n) * 0.5 + 1).bfloat16()
    for tables in ("pair", "shared_full"):  # the tolerance is stated for rotations
        cos, sin = _tables(tables, FP32)
        args = (q, k, wq, wk, cos, sin, EPS)
        want = qk_norm_rope.op.forward_native(
            *args, across_heads=across, layout=layout, convention=convention
        )
        with torch.inference_mode():
            got = qk_norm_rope(*args, across_heads=across, layout=layout, convention=convention)
        for g, w in zip(got, want):
            assert_fast_pairs(g, w, layout, max_ulp=2, slack=10)


@pytest.mark.parametrize("weights", ["none", "same", "fp32"])
def test_fast_fused_without_weights_or_in_fp32(small_blocks: None, weights: str) -> None:
    """No weight; a diffusers fp32 weight makes the output fp32: exact bits then."""
    q, k = _strided(BF16)
    cos, sin = _tables("pair", FP32)
    w = {"none": None, "same": torch.rand(D).bfloat16(), "fp32": torch.rand(D)}[weights]
    for convention in ("torch", "diffusers"):
        args = (q, k, w, w, cos, sin, EPS)
        want = qk_norm_rope.op.forward_native(
            *args, across_heads=False, layout="interleaved", convention=convention
        )
        with torch.inference_mode():
            got = qk_norm_rope(*args, convention=convention)
        if got[0].dtype == FP32:
            assert_exact(got[0], want[0])
        else:
            assert_fast_pairs(got[0], want[0], "interleaved", max_ulp=2, slack=10)


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
@pytest.mark.parametrize("layout", ["interleaved", "halves"])
@pytest.mark.parametrize("tables", ["pair", "shared_full", "unequal"])
@pytest.mark.parametrize("t_dtype", ["fp32", "same"])
def test_rotary_is_exact_in_both_modes(
    small_blocks: None, dtype: torch.dtype, layout: str, tables: str, t_dtype: str
) -> None:
    x, _ = _strided(dtype)
    cos, sin = _tables(tables, FP32 if t_dtype == "fp32" else dtype)
    want = rotary_embedding.op.forward_native(x, cos, sin, layout)
    with torch.inference_mode():
        assert_exact(rotary_embedding(x, cos, sin, layout), want)


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
@pytest.mark.parametrize("convention", ["torch", "diffusers"])
@pytest.mark.parametrize("w_dtype", [None, "same", FP32, BF16])
def test_rms_norm_exact_and_fast(
    small_blocks: None, dtype: torch.dtype, convention: str, w_dtype: Any
) -> None:
    torch.manual_seed(0)
    x = (torch.randn(5, 7, 48) * 3).to(dtype)[:, 1:]  # strided rows
    wd = dtype if w_dtype == "same" else w_dtype
    w = None if wd is None else (torch.randn(48) * 0.5 + 1).to(wd)
    want = rms_norm.op.forward_native(x, w, EPS, convention)
    rms_norm.op.precision = "exact"
    try:
        with torch.inference_mode():
            assert_exact(rms_norm(x, w, EPS, convention), want)
    finally:
        rms_norm.op.precision = None
    with torch.inference_mode():
        got = rms_norm(x, w, EPS, convention)
    if got.dtype == FP32:
        assert_exact(got, want)
    else:
        # diffusers with a bf16/fp16 weight rounds before and after it: 2 ulps
        assert_fast(got, want, max_ulp=2, slack=3)


def test_rms_norm_of_one_huge_row_is_exact() -> None:
    """A row long enough that a reduction could be split across threads."""
    x = torch.randn(1, 70000).bfloat16()
    want = rms_norm.op.forward_native(x, None, EPS, "torch")
    assert_exact(K.rms_norm(x, None, EPS, "torch", True), want)


def test_empty_inputs() -> None:
    q = torch.empty(2, 0, H, D)
    cos = torch.empty(1, 0, D // 2)
    qo, ko = K.qk_norm_rope(q, q, None, None, cos, cos, EPS, False, "interleaved", "torch", True)
    assert qo.shape == q.shape and ko.shape == q.shape
    assert K.rms_norm(torch.empty(0, 4), None, EPS, "torch", False).shape == (0, 4)


def test_pair_tables() -> None:
    c = torch.arange(8.0).repeat_interleave(2).view(1, 1, 16)
    t = rope_tables.pair_tables(c, c, 16, "interleaved")
    assert t.paired and torch.equal(t.c1, torch.arange(8.0).view(1, 1, 8))
    halves = torch.cat([torch.arange(8.0)] * 2).view(1, 1, 16)
    assert rope_tables.pair_tables(halves, halves, 16, "halves").paired
    assert not rope_tables.pair_tables(halves, halves, 16, "interleaved").paired
    signed = c.clone()
    signed[..., 1] = -0.0  # 0.0 and -0.0 are equal numbers but not the same bits
    assert not rope_tables.pair_tables(signed, c, 16, "interleaved").paired
