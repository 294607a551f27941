"""``rms_norm_scale``: diffusers' RMSNorm times a modulation scale (plus a shift), with the
roundings Mochi, Z-Image and LTX-Video make between the steps, against those families'
eager expressions written out here (bitwise in exact precision, fp32/bf16/fp16); NaN/inf
as eager; bad arguments refused before anything runs."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ditops import config
from ditops.ops.rms_norm_scale import RMSNormScaleOp, rms_norm_scale
from tests.precision import assert_exact

diffusers = pytest.importorskip("diffusers")
from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm  # noqa: E402

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
DTYPES = [FP32, BF16, FP16]
EPS = 1e-6
B, L, C = 2, 37, 48


def _run(precision: str, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The op in ``precision``, strict: a path that fails raises instead of falling back
    to the meaning (which would pass every comparison here)."""
    strict = args[0].dtype != torch.float64  # fp64: no path takes it, the meaning runs
    with torch.inference_mode(), config.override(precision=precision, strict=strict):
        return rms_norm_scale(*args, **kwargs)


def _x(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, L, C, generator=g) * 3).to(dtype)


def _mod(dtype: torch.dtype, rows: int = 1, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, rows, C, generator=g) * 0.5).to(dtype)


def mochi_eager(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """MochiModulatedRMSNorm / MochiRMSNormZero: ``(rms(x.float()) * s).to(x.dtype)``."""
    norm = DiffusersRMSNorm(0, EPS, False)
    return (norm(x.to(torch.float32)) * s).to(x.dtype)


def z_image_eager(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """ZImageTransformerBlock: ``attention_norm1(x) * scale_msa`` in the model dtype."""
    norm = DiffusersRMSNorm(C, EPS, True).to(w.dtype)
    with torch.no_grad():
        norm.weight.copy_(w)
    return norm(x) * s


def ltx_eager(x: torch.Tensor, c: torch.Tensor, sh: torch.Tensor) -> torch.Tensor:
    """LTXVideoTransformerBlock: ``norm1(h) * (1 + c_msa) + s_msa`` in the model dtype."""
    norm = DiffusersRMSNorm(C, EPS, False)
    return norm(x) * (1 + c) + sh


@pytest.mark.parametrize("precision", ["exact", "fast"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mochi_arithmetic(dtype: torch.dtype, precision: str) -> None:
    x = _x(dtype)
    fp32_scale = 1 + _mod(dtype).to(FP32)  # 1 + scale[:, None].float()
    gate = torch.tanh(_mod(dtype, seed=2))  # tanh(gate)[:, None], model dtype
    for s in (fp32_scale, gate):
        with torch.inference_mode():
            want = mochi_eager(x, s)
        got = _run(precision, x, s, EPS, upcast=True)
        assert got.dtype == dtype
        assert_exact(got, want)


@pytest.mark.parametrize("precision", ["exact", "fast"])
@pytest.mark.parametrize("rows", [1, L])  # one row per sample; per token (Omni)
@pytest.mark.parametrize("dtype", DTYPES)
def test_z_image_arithmetic(dtype: torch.dtype, rows: int, precision: str) -> None:
    x = _x(dtype)
    w = (torch.randn(C, generator=torch.Generator().manual_seed(5)) * 0.3 + 1).to(dtype)
    s = 1.0 + _mod(dtype, rows)
    with torch.inference_mode():
        want = z_image_eager(x, w, s)
    got = _run(precision, x, s, EPS, weight=w)
    assert got.dtype == want.dtype
    assert_exact(got, want)


@pytest.mark.parametrize("precision", ["exact", "fast"])
@pytest.mark.parametrize("rows", [1, L])  # one timestep; one per token
@pytest.mark.parametrize("dtype", DTYPES)
def test_ltx_video_arithmetic(dtype: torch.dtype, rows: int, precision: str) -> None:
    x = _x(dtype)
    c, sh = _mod(dtype, rows), _mod(dtype, rows, seed=3)
    with torch.inference_mode():
        want = ltx_eager(x, c, sh)
    got = _run(precision, x, 1 + c, EPS, shift=sh)
    assert got.dtype == want.dtype
    assert_exact(got, want)


def test_fp32_weight_and_mixed_dtypes_follow_eager_promotion() -> None:
    """An fp32 weight keeps the norm in fp32; a bf16 scale on it multiplies in fp32."""
    x = _x(BF16)
    w = torch.randn(C) * 0.3 + 1
    s = 1 + _mod(BF16)
    sh = _mod(FP16, seed=4)
    with torch.inference_mode():
        n = DiffusersRMSNorm(C, EPS, True)
        n.weight.copy_(w)
        want = n(x) * s + sh
    got = _run("exact", x, s, EPS, weight=w, shift=sh)
    assert got.dtype == want.dtype == FP32
    assert_exact(got, want)


def test_shared_scale_rows_and_non_contiguous_inputs() -> None:
    x = _x(BF16).transpose(0, 1).contiguous().transpose(0, 1)  # strided
    s = 1 + torch.randn(C).to(BF16)  # [C]: every token
    s1 = (1 + _mod(BF16))[:1]  # [1, 1, C]: shared by the batch
    for scale in (s, s1):
        with torch.inference_mode():
            want = DiffusersRMSNorm(C, EPS, False)(x) * scale
        assert_exact(_run("exact", x, scale, EPS), want)


def test_rows_wider_than_a_block_and_many_blocks() -> None:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1, 3, 70000, generator=g).to(BF16)
    s = (1 + torch.randn(1, 1, 70000, generator=g)).to(BF16)
    with torch.inference_mode():
        want = DiffusersRMSNorm(0, EPS, False)(x) * s
    assert_exact(_run("exact", x, s, EPS), want)
    x = torch.randn(2, 3000, 256, generator=g).to(BF16)
    s = (1 + torch.randn(2, 1, 256, generator=g)).float()
    with torch.inference_mode():
        want = mochi_eager(x, s)
    assert_exact(_run("exact", x, s, EPS, upcast=True), want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_and_inf_propagate_as_eager(dtype: torch.dtype) -> None:
    x = _x(dtype)
    x[0, 1, 3] = float("nan")
    x[0, 2, 5] = float("inf")
    x[1, 4, 0] = float("-inf")
    s = 1 + _mod(dtype)
    s[1, 0, 7] = float("nan")
    sh = _mod(dtype, seed=3)
    sh[0, 0, 9] = float("inf")
    with torch.inference_mode():
        want_mochi = mochi_eager(x, s.float())
        want_ltx = ltx_eager(x, s - 1, sh)
    assert_exact(_run("exact", x, s.float(), EPS, upcast=True), want_mochi)
    assert_exact(_run("exact", x, s, EPS, shift=sh), want_ltx)
    assert want_ltx.isnan().any() and want_mochi.isinf().sum() == 0


def test_fp64_runs_the_meaning() -> None:
    x = _x(torch.float64)
    s = 1 + _mod(torch.float64)
    with torch.inference_mode():
        want = DiffusersRMSNorm(0, EPS, False)(x) * s
    assert_exact(_run("exact", x, s, EPS), want)


def test_the_cpu_path_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not a silent fall back to the meaning: the path is the one chosen."""
    from tests.integrations.spies import install_spies

    calls = install_spies(monkeypatch, [RMSNormScaleOp])
    _run("exact", _x(BF16), 1 + _mod(BF16), EPS)
    assert calls == {"rms_norm_scale": 1}


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"x": "x"}, TypeError, "x must be a tensor"),
        ({"x": torch.zeros(B, L, C, dtype=torch.int32)}, TypeError, "x dtype"),
        ({"x": torch.zeros(L, C)}, ValueError, r"\[B, L, C\]"),
        ({"scale": 2.0}, TypeError, "scale must be a tensor"),
        ({"scale": torch.ones(B, 1, C + 1)}, ValueError, "scale of shape"),
        ({"scale": torch.ones(3, 1, C)}, ValueError, "scale of shape"),
        ({"scale": torch.ones(B, 5, C)}, ValueError, "scale of shape"),
        ({"scale": torch.ones(B, 1, C, dtype=torch.int64)}, TypeError, "scale dtype"),
        ({"shift": torch.ones(B, 2, 1, C)}, ValueError, "shift of shape"),
        ({"weight": torch.ones(C + 1)}, ValueError, "weight must have shape"),
        ({"eps": "1e-6"}, TypeError, "eps"),
        ({"eps": None}, TypeError, "eps"),
        ({"upcast": "yes"}, TypeError, "upcast"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict, error: type, match: str) -> None:
    args: dict[str, Any] = {"x": _x(BF16), "scale": 1 + _mod(BF16), "eps": EPS}
    args.update(kwargs)
    with pytest.raises(error, match=match):
        rms_norm_scale(**args)


def test_a_scale_on_another_device_is_refused() -> None:
    with pytest.raises(ValueError, match="scale is on meta but x is on cpu"):
        rms_norm_scale(_x(BF16), torch.ones(B, 1, C, device="meta"), EPS)


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_path_under_the_interpreter(dtype: torch.dtype) -> None:
    """Dispatched as CUDA (Triton's interpreter on CPU tensors), strict, fast precision:
    each family's form within 1 ulp of its eager expression (fp32: rtol 1e-5)."""
    import ditops
    from ditops.custom_op import reset_state
    from tests.precision import assert_fast

    x = _x(dtype)
    w = (torch.randn(C, generator=torch.Generator().manual_seed(5)) * 0.3 + 1).to(dtype)
    s, sh = 1 + _mod(dtype, L), _mod(dtype, seed=3)
    with torch.inference_mode():
        cases = [
            (mochi_eager(x, s.float()), (x, s.float(), EPS), {"upcast": True}),
            (z_image_eager(x, w, s), (x, s, EPS), {"weight": w}),
            (ltx_eager(x, s - 1, sh), (x, s, EPS), {"shift": sh}),
        ]
    reset_state()
    try:
        with ditops.force_device_kind({"cpu": "cuda"}):
            got = [_run("fast", *a, **kw) for _, a, kw in cases]
    finally:
        reset_state()
    for out, (want, _, _) in zip(got, cases):
        if dtype == FP32:
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
        else:
            assert_fast(out, want, max_ulp=1)


@pytest.mark.parametrize(
    ("x_dt", "w_dt", "s_dt", "h_dt"),
    [
        (BF16, FP16, FP16, None),  # the norm in the weight's dtype, one low dtype after
        (BF16, BF16, FP32, None),  # the product promoted to fp32
        (FP16, None, FP16, FP32),  # the sum promoted to fp32
        (BF16, None, BF16, FP16),  # bf16 + fp16: fp32
        (FP32, BF16, BF16, BF16),  # a bf16 weight on fp32 x: rounded to bf16 first
    ],
)
def test_mixed_dtypes_follow_eager_promotion(
    x_dt: torch.dtype, w_dt: Any, s_dt: torch.dtype, h_dt: Any
) -> None:
    x = _x(x_dt)
    w = None if w_dt is None else (torch.randn(C) * 0.3 + 1).to(w_dt)
    s, sh = 1 + _mod(s_dt, L), None if h_dt is None else _mod(h_dt, seed=3)
    with torch.inference_mode():
        n = DiffusersRMSNorm(C, EPS, w is not None)
        if w is not None:
            n = n.to(w_dt)
            n.weight.copy_(w)
        want = n(x) * s
        want = want if sh is None else want + sh
    got = _run("exact", x, s, EPS, weight=w, shift=sh)
    assert got.dtype == want.dtype
    assert_exact(got, want)


def test_rows_wider_than_the_triton_kernel_holds_run_the_meaning_and_say_why() -> None:
    import ditops
    from ditops.custom_op import reset_state
    from ditops.ops.qk_norm_rope import TRITON_MAX_ROW

    x = torch.randn(1, 2, TRITON_MAX_ROW + 2).to(BF16)
    s = torch.ones(1, 1, TRITON_MAX_ROW + 2, dtype=BF16)
    reset_state()
    try:
        with ditops.force_device_kind({"cpu": "cuda"}), config.override(precision="fast"):
            decision = rms_norm_scale.op.explain_call(x, s, EPS)
    finally:
        reset_state()
    assert decision.chosen == "forward_native"
    reasons = [r for p in decision.candidates for r in p.reasons]
    assert any(f"the Triton kernel holds <= {TRITON_MAX_ROW}" in r for r in reasons)
