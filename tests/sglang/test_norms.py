"""sglang's four norm modules dispatch to ditops under ditops' platform, and compute
sglang's native expression: fp32 bitwise, bf16 within the stated tolerance."""

from __future__ import annotations

import pytest
import torch
from sglang.multimodal_gen.runtime.layers import layernorm as ln

import ditops
from ditops.integrations.sglang import norms
from tests.sglang.helpers import (
    ditops_platform,
    native_expression,
    pair,
    stock_cpu_platform,
    ulps,
)

B, F, HW, C = 2, 3, 4, 64
L = F * HW


@pytest.fixture(autouse=True)
def _inference():
    """sglang denoises without autograd; ditops' fast paths are inference-only."""
    norms._warned.clear()
    with torch.no_grad():
        yield
    assert not norms._warned, f"fell back to sglang's expression: {norms._warned}"


_pair = pair


def test_forwards_are_bound_to_ditops_under_its_platform_only() -> None:
    with ditops_platform():
        mine = ln.LayerNormScaleShift(C, elementwise_affine=True)
    with stock_cpu_platform():
        stock = ln.LayerNormScaleShift(C, elementwise_affine=True)
    assert mine._forward_method.func is norms.layer_norm_scale_shift_forward
    assert mine.norm._forward_method.func is norms.fp32_layer_norm_forward
    assert stock._forward_method == stock.forward_cpu  # sgl_kernel's, as stock


@pytest.mark.parametrize("affine", [True, False])
def test_fp32_layer_norm(affine: bool) -> None:
    mine, ref = _pair(lambda: ln.FP32LayerNorm(C, elementwise_affine=affine, eps=1e-6))
    x = torch.randn(B, L, C) * 3 + 1
    assert torch.equal(mine(x), ref(x))
    xb = x.bfloat16()
    with ditops.override(precision="exact"):
        assert torch.equal(mine(xb), ref(xb))
    assert ulps(mine(xb), ref(xb), ref(xb)) <= 1


def test_rms_norm_with_and_without_residual() -> None:
    mine, ref = _pair(lambda: ln.RMSNorm(C, eps=1e-6))
    x, r = torch.randn(B, L, C), torch.randn(B, L, C)
    assert torch.equal(mine(x), ref.forward_native(x))
    out, res = mine(x, r)
    ref_out, ref_res = ref.forward_native(x, r)
    assert torch.equal(out, ref_out) and torch.equal(res, ref_res)
    xb, rb = x.bfloat16(), r.bfloat16()
    with ditops.override(precision="exact"):
        out, res = mine(xb, rb)
    ref_out, ref_res = ref.forward_native(xb, rb)
    assert torch.equal(out, ref_out) and torch.equal(res, ref_res)


def _mods(kind: str, dtype: torch.dtype):
    """(shift, scale) in sglang's conventions."""
    g = torch.Generator().manual_seed(2)
    if kind == "null":  # sglang's "no shift/scale"
        z = torch.zeros((1,), dtype=dtype)
        return z, z
    if kind == "row_model_dtype":  # modulation in the stream's dtype, not fp32
        kind, dtype = "row", torch.bfloat16
    else:
        dtype = torch.float32
    shape = {"row": (B, 1, C), "frames": (B, F, 1, C), "2d": (B, C), "vector": (C,)}[kind]
    return tuple((torch.randn(shape, generator=g) * 0.5).to(dtype) for _ in range(2))


@pytest.mark.parametrize("kind", ["row", "frames", "null", "2d", "vector"])
def test_layer_norm_scale_shift_fp32_bitwise(kind: str) -> None:
    mine, ref = _pair(lambda: ln.LayerNormScaleShift(C, eps=1e-6, elementwise_affine=True))
    x = torch.randn(B, L, C) * 2
    shift, scale = _mods(kind, torch.float32)
    with native_expression():
        expected = ref.forward_native(x, shift, scale)
    got = mine(x, shift, scale)
    assert got.dtype == expected.dtype and torch.equal(got, expected)


@pytest.mark.parametrize("kind", ["row", "frames", "null"])
def test_layer_norm_scale_shift_bf16_within_one_rounding(kind: str) -> None:
    mine, ref = _pair(lambda: ln.LayerNormScaleShift(C, eps=1e-6, elementwise_affine=False))
    x = (torch.randn(B, L, C) * 2).bfloat16()
    shift, scale = _mods(kind, torch.bfloat16 if kind == "null" else torch.float32)
    with native_expression():
        expected = ref.forward_native(x, shift, scale)
    got = mine(x, shift, scale)
    assert got.dtype == expected.dtype == torch.bfloat16
    normed = torch.nn.functional.layer_norm(x.float(), (C,), eps=1e-6)
    size = normed.abs() * (1 + _rows(scale).abs()) + _rows(shift).abs()
    assert ulps(got, expected, size) <= 2


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A modulation broadcast over [B, L, C] (per-frame ones expanded)."""
    if t.dim() == 4:
        return t.expand(-1, -1, L // t.shape[1], -1).flatten(1, 2).float()
    return t.float()


@pytest.mark.parametrize(
    ("gate_kind", "mod_kind"),
    [("row", "null"), ("frames", "frames"), ("one", "row"), ("row", "row_model_dtype")],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scale_residual_layer_norm_scale_shift(
    gate_kind: str, mod_kind: str, dtype: torch.dtype
) -> None:
    """Wan's three calls: self-attention (fp32 row gate, null modulation), a per-frame gate
    (Wan 2.2 TI2V), cross-attention (gate=1). fp32 bitwise; in bf16 the fp32 residual
    sglang returns is bitwise, the modulated output within one rounding."""
    mine, ref = _pair(
        lambda: ln.ScaleResidualLayerNormScaleShift(C, eps=1e-6, elementwise_affine=True)
    )
    residual, x = (torch.randn(B, L, C) * 2).to(dtype), torch.randn(B, L, C).to(dtype)
    g = torch.Generator().manual_seed(3)
    gate = {
        "row": torch.randn(B, 1, C, generator=g),
        "frames": torch.randn(B, F, 1, C, generator=g),
        "one": 1,
    }[gate_kind]
    shift, scale = _mods(mod_kind, dtype)
    if mod_kind == "row_model_dtype":
        shift, scale = shift.to(dtype), scale.to(dtype)
    with native_expression():
        expected, expected_res = ref.forward_native(residual, x, gate, shift, scale)
    got, got_res = mine(residual, x, gate, shift, scale)
    assert got.dtype == expected.dtype and got_res.dtype == expected_res.dtype
    assert torch.equal(got_res, expected_res)
    if expected_res.dtype == torch.float32:  # fp32 stream, or bf16 widened by an fp32 gate
        assert torch.equal(got, expected)
    else:  # sglang rounds LN(h) to bf16 before modulating; ditops keeps it in fp32
        w, b = ref.norm.weight, ref.norm.bias
        normed = torch.nn.functional.layer_norm(expected_res.float(), (C,), w, b, eps=1e-6)
        size = normed.abs() * (1 + _rows(scale).abs()) + _rows(shift).abs()
        assert ulps(got, expected, size, dtype) <= 2


def test_gate_one_is_the_int_only() -> None:
    mine, _ = _pair(lambda: ln.ScaleResidualLayerNormScaleShift(C, eps=1e-6))
    r = torch.randn(B, L, C)
    z = torch.zeros((1,))
    with pytest.raises(ValueError, match="int gate 1"):
        mine(r, r, 2, z, z)
    with pytest.raises(ValueError, match="not supported"):
        mine(r, r, 1.0, z, z)


def test_nan_propagates_as_in_the_meaning() -> None:
    mine, ref = _pair(lambda: ln.LayerNormScaleShift(C, eps=1e-6))
    x = torch.randn(B, L, C)
    x[0, 3, 5] = float("nan")
    shift, scale = _mods("row", torch.float32)
    with native_expression():
        expected = ref.forward_native(x, shift, scale)
    got = mine(x, shift, scale)
    assert torch.equal(got.isnan(), expected.isnan())
    assert torch.equal(got.nan_to_num(), expected.nan_to_num())


def test_the_cpu_kernels_run_not_the_meaning(monkeypatch: pytest.MonkeyPatch) -> None:
    """The forwards reach ditops' CPU kernels (a spy on them), in Wan's bf16 calls."""
    from ditops.kernels.cpu import modulation as kernels

    seen: list[str] = []
    for name in ("layer_norm_scale_shift", "scale_residual_layer_norm_scale_shift"):
        real = getattr(kernels, name)
        monkeypatch.setattr(
            kernels, name, lambda *a, _n=name, _f=real, **k: seen.append(_n) or _f(*a, **k)
        )
    norm, _ = _pair(lambda: ln.LayerNormScaleShift(C, eps=1e-6))
    fused, _ = _pair(lambda: ln.ScaleResidualLayerNormScaleShift(C, eps=1e-6))
    x = torch.randn(B, L, C).bfloat16()
    shift, scale = _mods("row", torch.float32)
    null, _ = _mods("null", torch.bfloat16)
    norm(x, shift, scale)
    fused(x, x, scale, null, null)  # Wan's self-attention call: the fp32 gate widens h
    fused(x, x, 1, shift, scale)  # its cross-attention call: the stream keeps bf16
    assert seen == [
        "layer_norm_scale_shift",
        "layer_norm_scale_shift",
        "scale_residual_layer_norm_scale_shift",
    ]


def test_the_npu_paths_run_inside_sglang(on_npu) -> None:
    """Under ditops' NPU platform (CPU tensors taking ditops' ``npu`` paths; the legacy
    ``attentions`` package as tests/doubles' double of it), sglang's norm modules reach the
    NPU layer norm, and give sglang's meaning within ditops' fast contract."""
    from tests.doubles.npu_attentions import fake_attentions

    with ditops_platform("npu"):
        mine = ln.LayerNormScaleShift(C, eps=1e-6, elementwise_affine=True)
        fp32 = ln.FP32LayerNorm(C, eps=1e-6)
    with stock_cpu_platform():
        ref = ln.LayerNormScaleShift(C, eps=1e-6, elementwise_affine=True)
    ref.load_state_dict(mine.state_dict())
    x = (torch.randn(B, L, C) * 2).bfloat16()
    shift, scale = _mods("row", torch.float32)
    with fake_attentions() as calls:
        got = mine(x, shift, scale)
        normed = fp32(x)
    assert len(calls.of("layernorm")) == B + 1  # one per sample (its modulation folded in), one
    with native_expression():
        expected = ref.forward_native(x, shift, scale)
    size = torch.nn.functional.layer_norm(x.float(), (C,), eps=1e-6).abs()
    assert ulps(got, expected, size * (1 + _rows(scale).abs()) + _rows(shift).abs()) <= 2
    assert ulps(normed, fp32.forward_native(x), size) <= 1


def test_the_cuda_paths_run_inside_sglang(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ditops' CUDA platform, CPU tensors taking ditops' ``cuda`` paths (its Triton
    kernels, run by Triton's interpreter here; strict: a kernel failure raises): Wan's
    self-attention residual norm, within ditops' Triton contract of sglang's fp32 meaning."""
    with ditops_platform("cuda"):
        mine = ln.ScaleResidualLayerNormScaleShift(C, eps=1e-6, elementwise_affine=True)
    with stock_cpu_platform():
        ref = ln.ScaleResidualLayerNormScaleShift(C, eps=1e-6, elementwise_affine=True)
    ref.load_state_dict(mine.state_dict())
    residual, x = torch.randn(B, L, C), torch.randn(B, L, C)
    gate = torch.randn(B, 1, C)
    shift, scale = _mods("row", torch.float32)
    from ditops.kernels.triton import modulation as kernels

    seen: list[str] = []
    real = kernels.scale_residual_layer_norm_scale_shift
    monkeypatch.setattr(
        kernels,
        "scale_residual_layer_norm_scale_shift",
        lambda *a, **k: seen.append(1) or real(*a, **k),
    )
    with ditops.force_device_kind({"cpu": "cuda"}), ditops.override(strict=True):
        got, got_res = mine(residual, x, gate, shift, scale)
    assert seen == [1]
    with native_expression():
        expected, expected_res = ref.forward_native(residual, x, gate, shift, scale)
    assert torch.equal(got_res, expected_res)  # the gated residual is exact on Triton
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
