"""More of sglang's ops on ditops (MulAdd, RMSNormNoWeight, the RMS modulated norms, the
tanh GELUs), each against the op's own ``forward_native``: the precision stated in
:mod:`ditops.integrations.sglang.elementwise`."""

from __future__ import annotations

import pytest
import torch
from sglang.multimodal_gen.runtime.layers import activation as act
from sglang.multimodal_gen.runtime.layers import layernorm as ln
from sglang.multimodal_gen.runtime.layers.elementwise import MulAdd

import ditops
from ditops.integrations.sglang import elementwise as ew
from ditops.integrations.sglang import norms
from tests.sglang.helpers import (
    native_expression,
    pair,
    stock_cpu_platform,
    ulps,
)

B, F, HW, C = 2, 3, 4, 64
L = F * HW


@pytest.fixture(autouse=True)
def _inference():
    ew._warned.clear()
    norms._warned.clear()
    with torch.no_grad():
        yield
    assert not ew._warned and not norms._warned, "fell back to sglang's expression"


_pair = pair


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate", ["row", "frames", "fp32-row"])
@pytest.mark.parametrize("k", [0, 1])
def test_mul_add_is_sglang_s_expression_bitwise(dtype, gate, k) -> None:
    mine, ref = _pair(MulAdd)
    assert mine._forward_method.func is ew.mul_add_forward
    a, c = torch.randn(B, L, C).to(dtype), torch.randn(B, L, C).to(dtype)
    shape = (B, F, 1, C) if gate == "frames" else (B, 1, C)
    b = torch.randn(shape).to(torch.float32 if gate == "fp32-row" else dtype)
    got, want = mine(a, b, c, k), ref.forward_native(a, b, c, k)
    assert got.dtype == want.dtype and torch.equal(got, want)


def test_mul_add_runs_ditops_op(monkeypatch) -> None:
    seen = []
    real = ew.adaln_residual
    monkeypatch.setattr(ew, "adaln_residual", lambda *a: seen.append(1) or real(*a))
    mine, _ = _pair(MulAdd)
    mine(torch.randn(B, L, C), torch.randn(B, 1, C), torch.randn(B, L, C))
    assert seen == [1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_no_weight(dtype) -> None:
    mine, ref = _pair(ln.RMSNormNoWeight)
    assert mine._forward_method.func is ew.rms_norm_no_weight_forward
    x = (torch.randn(B, L, C) * 3).to(dtype)
    want = ref.forward_native(x, 1e-6)
    with ditops.override(precision="exact"):
        assert torch.equal(mine(x, 1e-6), want)
    assert ulps(mine(x, 1e-6), want, want) <= 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_scale_shift_runs_on_cpu(dtype) -> None:
    """Stock sglang fails this op on a CPU (sgl_kernel); ditops gives sglang's native
    expression with ditops' RMSNorm inside: fp32 bitwise, bf16 within the RMSNorm's ulp."""
    mine, ref = _pair(lambda: ln.RMSNormScaleShift(C, eps=1e-6))
    assert mine._forward_method.func is ew.rms_norm_scale_shift_forward
    assert mine.norm._forward_method.func is norms.rms_norm_forward
    x = torch.randn(B, L, C).to(dtype)
    shift, scale = torch.randn(B, 1, C).to(dtype), torch.randn(B, 1, C).to(dtype)
    with stock_cpu_platform(), pytest.raises(Exception, match="sgl_kernel"):
        ref(x, shift, scale)
    with native_expression():
        want = ref.forward_native(x, shift, scale)
    with ditops.override(precision="exact"):
        assert torch.equal(mine(x, shift, scale), want)


@pytest.mark.parametrize("gate", ["row", "frames", 1])
def test_scale_residual_rms_norm_scale_shift_runs_on_cpu(gate) -> None:
    mine, ref = _pair(lambda: ln.ScaleResidualRMSNormScaleShift(C, eps=1e-6))
    assert mine._forward_method.func is ew.scale_residual_rms_norm_scale_shift_forward
    residual, x = torch.randn(B, L, C), torch.randn(B, L, C)
    g = gate if gate == 1 else torch.randn((B, F, 1, C) if gate == "frames" else (B, 1, C))
    shift, scale = torch.randn(B, 1, C), torch.randn(B, 1, C)
    with pytest.raises(Exception, match="sgl_kernel"), stock_cpu_platform():
        ref(residual, x, g, shift, scale)
    got = mine(residual, x, g, shift, scale)
    with native_expression():
        want = ref.forward_native(residual, x, g, shift, scale)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gelu_and_mul_tanh_bitwise_and_none_stays_sglang_s(dtype) -> None:
    tanh, ref = _pair(lambda: act.GeluAndMul("tanh"))
    plain, _ = _pair(lambda: act.GeluAndMul("none"))
    x = (torch.randn(B, L, 2 * C) * 3).to(dtype)
    assert torch.equal(tanh(x), ref.forward_native(x))
    assert torch.equal(plain(x), plain.forward_native(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_new_gelu_within_its_stated_ulps(dtype) -> None:
    """Measured at the magnitude ``|GELU(x)| + |x| / 2``: sglang's spelling loses its
    precision in ``1 + tanh(...)`` for x << 0 (torch 2.14's fused GELU returns 0 there,
    2.13's the spelled value), an error of ``|x| / 2`` times a rounding of 1."""
    mine, ref = _pair(act.NewGELU)
    assert mine._forward_method.func is ew.new_gelu_forward
    x = (torch.linspace(-8, 8, 40001)).to(dtype)
    got, want = mine(x), ref.forward_native(x)
    assert got.dtype == want.dtype
    assert ulps(got, want, want.abs() + x.abs() / 2) <= 2
