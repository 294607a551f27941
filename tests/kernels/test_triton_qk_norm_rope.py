"""The Triton prologue kernels under Triton's interpreter, against the ops' meanings.

The rotation alone must be bitwise eager's (no FMA contraction, rounding to nearest
even done by the kernel: the interpreter's own bf16 cast truncates). The fused op is
held to its fast tolerance (ulps at the rotated pair's magnitude), the standalone norm
to 1 ulp (2 for diffusers' double rounding). Shapes are small: the interpreter is slow.
"""

from __future__ import annotations

import pytest
import torch

from ditops.kernels.triton import qk_norm_rope as T
from ditops.ops.qk_norm_rope import qk_norm_rope, rms_norm, rotary_embedding
from tests.precision import assert_exact, assert_fast, assert_fast_pairs, pair_magnitude

B, L, H, D = 2, 5, 3, 8
EPS = 1e-6
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _tables(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    ang = torch.rand(B, L, D // 2) * 6.3
    if kind == "pair":
        return ang.cos(), ang.sin()
    if kind == "shared_full":
        return ang[:1].cos().repeat_interleave(2, -1), ang[:1].sin().repeat_interleave(2, -1)
    return torch.randn(1, L, D), torch.randn(1, L, D)


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
@pytest.mark.parametrize("layout", ["interleaved", "halves"])
@pytest.mark.parametrize("tables", ["pair", "shared_full", "unequal"])
def test_rotation_is_bitwise_eager(dtype: torch.dtype, layout: str, tables: str) -> None:
    x = (torch.randn(B, L, 2 * H, D) * 3).to(dtype)[:, :, 1::2]  # strided heads
    x[0, 1, 0, 2] = float("nan")
    x[1, 3, 2, 5] = float("inf")
    cos, sin = _tables(tables)
    want = rotary_embedding.op.forward_native(x, cos.unsqueeze(2), sin.unsqueeze(2), layout)
    assert_exact(T.rotary_embedding(x, cos, sin, layout), want)


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
@pytest.mark.parametrize("convention", ["torch", "diffusers"])
@pytest.mark.parametrize("across", [False, True])
@pytest.mark.parametrize("layout", ["interleaved", "halves"])
def test_fused_within_tolerance(
    dtype: torch.dtype, convention: str, across: bool, layout: str
) -> None:
    torch.manual_seed(0)
    qkv = (torch.randn(B, L, 3 * H * D) * 2).to(dtype)
    q, k, _ = (t.unflatten(2, (H, D)) for t in qkv.chunk(3, dim=-1))
    n = H * D if across else D
    wq, wk = (torch.randn(n) * 0.5 + 1).to(dtype), (torch.randn(n) * 0.5 + 1).to(dtype)
    cos, sin = _tables("pair")
    args = (q, k, wq, wk, cos.unsqueeze(2), sin.unsqueeze(2), EPS)
    want = qk_norm_rope.op.forward_native(
        *args, across_heads=across, layout=layout, convention=convention
    )
    got = T.qk_norm_rope(q, k, wq, wk, cos, sin, EPS, across, layout, convention)
    for g, w in zip(got, want):
        if dtype == FP32:
            # a few fp32 roundings apart: relative to the pair's magnitude
            err = (g - w).abs() / pair_magnitude(w, layout).clamp_min(1e-30)
            assert float(err.max()) < 1e-5
        else:
            assert_fast_pairs(g, w, layout, max_ulp=2, slack=10)


def test_fused_without_weights_and_nan() -> None:
    q, k = torch.randn(B, L, H, D).bfloat16(), torch.randn(B, L, H, D).bfloat16()
    q[1, 2, 1, 3] = float("nan")
    cos, sin = _tables("shared_full")
    want = qk_norm_rope.op.forward_native(
        q, k, None, None, cos.unsqueeze(2), sin.unsqueeze(2), EPS, across_heads=False
    )
    got = T.qk_norm_rope(q, k, None, None, cos, sin, EPS, False, "interleaved", "torch")
    assert got[0][1, 2, 1].isnan().all() and not got[0][1, 2, 0].isnan().any()
    assert_fast_pairs(got[0], want[0], "interleaved", slack=10)
    assert_fast_pairs(got[1], want[1], "interleaved", slack=10)


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
@pytest.mark.parametrize("convention", ["torch", "diffusers"])
@pytest.mark.parametrize("w_dtype", [None, "same", FP32])
def test_rms_norm(dtype: torch.dtype, convention: str, w_dtype: object) -> None:
    torch.manual_seed(0)
    x = (torch.randn(3, 6, 2 * 40) * 3).to(dtype)[..., :40]  # strided rows
    wd = dtype if w_dtype == "same" else w_dtype
    w = None if wd is None else (torch.randn(40) * 0.5 + 1).to(wd)
    want = rms_norm.op.forward_native(x, w, EPS, convention)
    got = T.rms_norm(x, w, EPS, convention)
    if got.dtype == FP32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:
        lp_weight = convention == "diffusers" and wd in (BF16, FP16)
        assert_fast(got, want, max_ulp=2 if lp_weight else 1, slack=3)


def test_custom_ops_have_fakes() -> None:
    q = torch.randn(B, L, H, D)
    cos, sin = _tables("pair")
    checks = ("test_schema", "test_faketensor")
    ops = torch.ops.ditops
    torch.library.opcheck(
        ops.triton_qk_norm_rope.default,
        (q, q, torch.ones(D), torch.ones(D), cos, sin, EPS, False, "interleaved", "diffusers"),
        test_utils=checks,
    )
    torch.library.opcheck(
        ops.triton_rotary_embedding.default, (q, cos, sin, "halves"), test_utils=checks
    )
    torch.library.opcheck(ops.triton_rms_norm.default, (q, None, EPS, "torch"), test_utils=checks)
