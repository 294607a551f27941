"""The fp32 modulation ops (Wan's norm / modulation / residual chain) against Wan's own
expressions: every dtype mix, both precisions, bad input, compile, the Triton path
through the interpreter. The NPU path: test_modulation_fp32_npu.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ditops
import ditops.backends.npu
from ditops import config
from ditops.custom_op import registered_ops, reset_state
from ditops.layers.modulation import LayerNormScaleShift, ScaleResidualLayerNormScaleShift
from ditops.ops.modulation_args import ACCEPTED_SHAPES
from ditops.ops.modulation_fp32 import (
    gated_residual,
    layer_norm_scale_shift,
    scale_residual_layer_norm_scale_shift,
)
from tests.precision import assert_exact, assert_fast

B, L, C, FRAMES = 2, 8, 48, 4


EPS = 1e-6


ATOL = 1e-5  # the documented cancellation allowance of the fast norm


def _rnd(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.randn(*shape) * 0.5).to(dtype)


MODULATIONS = {
    "python": lambda dt: 0.25,
    "zero_dim": lambda dt: torch.tensor(-0.3, dtype=dt),
    "vector": lambda dt: _rnd(C, dtype=dt),
    "batch": lambda dt: _rnd(B, 1, C, dtype=dt),  # Wan2.1 / Wan2.2 A14B
    "token": lambda dt: _rnd(B, L, C, dtype=dt),  # Wan2.2 TI2V-5B
    "frame": lambda dt: _rnd(B, FRAMES, 1, C, dtype=dt),
}


DTYPE_MIXES = {
    "bf16-fp32": (torch.bfloat16, torch.float32),
    "bf16-bf16": (torch.bfloat16, torch.bfloat16),
    "fp16-fp32": (torch.float16, torch.float32),
    "fp16-fp16": (torch.float16, torch.float16),
}


def _unflat(h: torch.Tensor, m: Any) -> torch.Tensor:
    # A per-frame modulation [B, F, 1, C] meets the tokens unflattened into frames.
    return h.unflatten(1, (m.shape[1], -1)) if isinstance(m, torch.Tensor) and m.dim() == 4 else h


def wan_norm(norm: nn.Module, h: torch.Tensor, scale: Any, shift: Any) -> torch.Tensor:
    """``(norm(h.float()) * (1 + scale) + shift).type_as(h)``, as WanTransformerBlock."""
    y = norm(h.float())
    return (_unflat(y, scale) * (1 + scale) + shift).reshape(h.shape).type_as(h)


def wan_residual(h: torch.Tensor, out: torch.Tensor, gate: Any) -> torch.Tensor:
    """``(h.float() + out * gate).type_as(h)``, as WanTransformerBlock."""
    return (_unflat(h, gate).float() + _unflat(out, gate) * gate).reshape(h.shape).type_as(h)


def fp32_norm(affine: bool) -> nn.LayerNorm:
    """diffusers' FP32LayerNorm (norm1/norm3 without affine, norm2 with it)."""
    from diffusers.models.normalization import FP32LayerNorm

    norm = FP32LayerNorm(C, EPS, elementwise_affine=affine)
    if affine:
        with torch.no_grad():
            norm.weight.normal_()
            norm.bias.normal_()
    return norm


def _params(norm: nn.LayerNorm) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    return norm.weight, norm.bias


@pytest.mark.parametrize("precision", ["exact", "fast"])
@pytest.mark.parametrize("affine", [False, True], ids=["plain", "affine"])
@pytest.mark.parametrize("mix", list(DTYPE_MIXES))
@pytest.mark.parametrize("kind", list(MODULATIONS))
def test_cpu_matches_wan_expressions(kind: str, mix: str, affine: bool, precision: str) -> None:
    act, mod = DTYPE_MIXES[mix]
    h, attn = torch.randn(B, L, C).to(act) * 2, torch.randn(B, L, C).to(act)
    norm = fp32_norm(affine)
    w, b = _params(norm)
    gate, scale, shift = (MODULATIONS[kind](mod) for _ in range(3))
    check = assert_exact if precision == "exact" else lambda o, r: assert_fast(o, r, atol=ATOL)
    with torch.no_grad(), config.override(precision=precision):
        assert (
            layer_norm_scale_shift.op.explain_call(h, w, b, scale, shift, EPS, None).chosen
            == "forward_cpu"
        )
        check(layer_norm_scale_shift(h, w, b, scale, shift, EPS), wan_norm(norm, h, scale, shift))
        ref_res = wan_residual(h, attn, gate)
        assert_exact(gated_residual(h, attn, gate), ref_res)
        out, new_res = scale_residual_layer_norm_scale_shift(h, attn, gate, w, b, scale, shift, EPS)
        assert_exact(new_res, ref_res)
        check(out, wan_norm(norm, ref_res, scale, shift))


@pytest.mark.parametrize("kind", list(MODULATIONS))
def test_native_is_the_wan_expression(kind: str) -> None:
    h, attn = torch.randn(B, L, C).bfloat16(), torch.randn(B, L, C).bfloat16()
    norm = fp32_norm(True)
    gate, scale, shift = (MODULATIONS[kind](torch.float32) for _ in range(3))
    with torch.no_grad():
        out, new_res = scale_residual_layer_norm_scale_shift.op.forward_native(
            h, attn, gate, norm.weight, norm.bias, scale, shift, EPS, None
        )
    ref_res = wan_residual(h, attn, gate)
    assert_exact(new_res, ref_res)
    assert_exact(out, wan_norm(norm, ref_res, scale, shift))


def test_wan_block_sequence_exact() -> None:
    # The four steps of one Wan block around its attentions and FFN, in exact mode.
    h = torch.randn(B, L, C).bfloat16()
    temb = torch.randn(B, 6, C)
    table = torch.randn(1, 6, C) / C**0.5
    shift, scale, gate, c_shift, c_scale, c_gate = (table + temb.float()).chunk(6, dim=1)
    norm1, norm2, norm3 = fp32_norm(False), fp32_norm(True), fp32_norm(False)
    a1, a2, ff = (torch.randn(B, L, C).bfloat16() for _ in range(3))
    # diffusers
    n1 = wan_norm(norm1, h, scale, shift)
    r1 = wan_residual(h, a1, gate)
    n2 = norm2(r1.float()).type_as(r1)
    r2 = r1 + a2
    n3 = wan_norm(norm3, r2, c_scale, c_shift)
    r3 = (r2.float() + ff.float() * c_gate).type_as(r2)
    # ditops
    with torch.no_grad(), config.override(precision="exact"):
        m1 = layer_norm_scale_shift(h, None, None, scale, shift, EPS)
        m2, s1 = scale_residual_layer_norm_scale_shift(
            h, a1, gate, norm2.weight, norm2.bias, None, None, EPS
        )
        m3, s2 = scale_residual_layer_norm_scale_shift(s1, a2, 1, None, None, c_scale, c_shift, EPS)
        s3 = gated_residual(s2, ff.float(), c_gate)
    for got, ref in ((m1, n1), (s1, r1), (m2, n2), (s2, r2), (m3, n3), (s3, r3)):
        assert_exact(got, ref)


def test_two_dim_activations_and_out_dtype() -> None:
    x = torch.randn(L, C).bfloat16()
    scale, shift = _rnd(C), _rnd(1, L, C)
    ref = (F.layer_norm(x.float(), (C,), None, None, EPS) * (1 + scale) + shift)[0]
    for precision in ("exact", "fast"):
        with torch.no_grad(), config.override(precision=precision):
            out = layer_norm_scale_shift(x, None, None, scale, shift, EPS, torch.float32)
            assert_exact(out, ref)  # an fp32 output is exact in both precisions
            assert out.shape == (L, C)
            assert_exact(gated_residual(x, x, 1), (x.float() + x).bfloat16())


def test_grad_runs_native_and_reaches_inputs() -> None:
    x = torch.randn(B, L, C, requires_grad=True)
    scale = _rnd(B, 1, C).requires_grad_()
    mod = LayerNormScaleShift(C, eps=EPS)
    decision = mod.op.explain_call(x, mod.weight, mod.bias, scale, None, EPS, None)
    assert decision.chosen == "forward_native"
    assert "grad" in " ".join(decision.candidates[0].reasons)
    mod(x, scale).sum().backward()
    assert x.grad is not None and scale.grad is not None and mod.weight.grad is not None


def _ln(**kw: Any) -> Any:
    args = {
        "x": torch.randn(B, L, C).bfloat16(),
        "weight": None,
        "bias": None,
        "scale": None,
        "shift": None,
        "eps": EPS,
    }
    args.update(kw)
    return layer_norm_scale_shift(**args)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"x": torch.randn(B, L, 2, C)}, ValueError, r"\[B, L, C\] or \[L, C\]"),
        ({"x": torch.ones(B, L, C, dtype=torch.int32)}, TypeError, "int32"),
        ({"scale": torch.randn(B, C)}, ValueError, "accepted modulation shapes"),
        ({"scale": torch.randn(B, 3, 1, C)}, ValueError, "not divisible by F = 3"),
        ({"scale": torch.randn(B, 1, C + 1)}, ValueError, "!= C"),
        ({"shift": torch.randn(C).half()}, TypeError, "float16; expected float32 or bfloat16"),
        ({"scale": True}, TypeError, "got bool"),
        ({"weight": torch.randn(C + 1)}, ValueError, r"weight must have shape \[C\]"),
        ({"eps": "1e-6"}, TypeError, "eps must be a real number"),
        ({"out_dtype": torch.int8}, TypeError, "out_dtype"),
        (
            {"scale": torch.randn(B, 2, 1, C), "shift": torch.randn(B, 4, 1, C)},
            ValueError,
            "same number",
        ),
    ],
    ids=[
        "rank",
        "int",
        "2d_mod",
        "frames",
        "C",
        "fp16_mod",
        "bool",
        "weight",
        "eps",
        "out_dtype",
        "mixed_F",
    ],
)
def test_bad_input_is_explained(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match) as info:
        _ln(**kwargs)
    if error is ValueError and "scale" in kwargs and "shift" not in kwargs:
        assert ACCEPTED_SHAPES in str(info.value)


def test_bad_residual_pairs() -> None:
    r = torch.randn(B, L, C).bfloat16()
    with pytest.raises(ValueError, match="expected the residual's shape"):
        gated_residual(r, torch.randn(B, L + 1, C).bfloat16(), 1)
    with pytest.raises(TypeError, match="expected the residual's dtype torch.bfloat16 or float32"):
        gated_residual(r, torch.randn(B, L, C).half(), 1)
    with pytest.raises(TypeError, match="gate has dtype float16"):
        gated_residual(r, r, torch.randn(B, 1, C).half())
    with pytest.raises(ValueError, match="accepted modulation shapes"):
        scale_residual_layer_norm_scale_shift(
            r, r, torch.randn(B, 3, C), None, None, None, None, EPS
        )


def test_ops_are_registered_and_explained() -> None:
    names = {"layer_norm_scale_shift", "gated_residual", "scale_residual_layer_norm_scale_shift"}
    assert names <= set(registered_ops())
    for name in names:
        decisions = ditops.explain(name, ["cpu", "mps"])
        assert [d.chosen for d in decisions] == ["forward_cpu", "forward_native"]


def test_torch_compile_exact() -> None:
    torch._dynamo.reset()
    mod = ScaleResidualLayerNormScaleShift(C, eps=EPS, elementwise_affine=False, precision="exact")
    h, attn = torch.randn(B, L, C).bfloat16(), torch.randn(B, L, C).bfloat16()
    gate, scale, shift = _rnd(B, 1, C), _rnd(B, L, C), _rnd(B, 1, C)

    def block(h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        n, h = mod(h, attn, gate, scale, shift)
        return gated_residual(h, n, gate)

    with torch.no_grad():
        eager = block(h, attn)
        compiled = torch.compile(block, fullgraph=True)(h, attn)
    assert_exact(compiled, eager)


@pytest.fixture
def on_cuda() -> Any:
    reset_state()
    with ditops.force_device_kind({"cpu": "cuda"}), torch.no_grad(), config.override(strict=True):
        yield
    reset_state()


@pytest.mark.parametrize(
    ("kind", "mod"),
    [
        ("batch", torch.float32),
        ("token", torch.float32),
        ("frame", torch.bfloat16),
        ("zero_dim", torch.bfloat16),
        ("vector", torch.float32),
    ],
)
def test_triton_path(on_cuda: None, kind: str, mod: torch.dtype) -> None:
    h, attn = torch.randn(B, L, C).bfloat16(), torch.randn(B, L, C).bfloat16()
    norm = fp32_norm(kind == "vector")
    w, b = _params(norm)
    gate, scale, shift = (MODULATIONS[kind](mod) for _ in range(3))
    args = (h, attn, gate, w, b, scale, shift, EPS, None)
    assert scale_residual_layer_norm_scale_shift.op.explain_call(*args).chosen == "forward_cuda"
    out, new_res = scale_residual_layer_norm_scale_shift(*args[:-1])
    ref_res = wan_residual(h, attn, gate)
    assert_exact(new_res, ref_res)  # the kernel reproduces eager's roundings
    # 1 ulp on any number of elements: the interpreter's statistics differ from ATen's.
    assert_fast(out, wan_norm(norm, ref_res, scale, shift), max_fraction=1.0, atol=ATOL)
    assert_exact(gated_residual(h, attn, gate), ref_res)
    out = layer_norm_scale_shift(h, w, b, scale, shift, EPS)
    assert_fast(out, wan_norm(norm, h, scale, shift), max_fraction=1.0, atol=ATOL)


def test_triton_path_without_modulation(on_cuda: None) -> None:
    # Wan's norm2: an affine FP32LayerNorm after the gated residual, nothing to modulate.
    norm = fp32_norm(True)
    h, attn = torch.randn(L, C).bfloat16(), torch.randn(L, C).bfloat16()
    out, new_res = scale_residual_layer_norm_scale_shift(
        h, attn, 1, norm.weight, norm.bias, None, None, EPS
    )
    assert_exact(new_res, (h.float() + attn).bfloat16())
    assert_fast(out, norm(new_res.float()).bfloat16(), max_fraction=1.0, atol=ATOL)


def test_triton_declines_scalar_gate_on_low_precision(on_cuda: None) -> None:
    h, attn = torch.randn(B, L, C).bfloat16(), torch.randn(B, L, C).bfloat16()
    decision = gated_residual.op.explain_call(h, attn, 0.5)
    assert decision.chosen == "forward_native"
    assert "scalar gate" in decision.candidates[0].reasons[0]
    assert_exact(gated_residual(h, attn, 0.5), wan_residual(h, attn, 0.5))
