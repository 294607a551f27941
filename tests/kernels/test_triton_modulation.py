"""The Triton modulation kernels under Triton's interpreter, against the eager expressions.

``gated_residual`` (and the new residual of the fused op) must be bitwise equal to eager:
the kernel reproduces eager's roundings and rounds to nearest even itself (the
interpreter's own fp32 -> bf16 cast truncates). Normalised outputs are held to the
LayerNorm tolerance of test_triton_layer_norm.assert_matches (1 ulp, or fp32 within
1e-5). Modulation tensors come as the caller passes them: [Bm, G, C], any strides.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ditops.kernels.triton import layer_norm as tln
from ditops.kernels.triton import modulation as tmod
from tests.kernels.test_triton_layer_norm import BF16, FP16, FP32, assert_matches, make_affine

B, L, C, FRAMES = 2, 6, 100, 3
EPS = 1e-6


def _rnd(*shape: int, dt: torch.dtype) -> torch.Tensor:
    return (torch.randn(*shape) * 0.5).to(dt)


# How the caller hands each modulation shape to the kernels: [Bm, G, C].
_MODULATIONS = {
    "scalar": lambda dt: torch.tensor(0.25, dtype=dt).expand(1, 1, C),  # all strides 0
    "vector": lambda dt: _rnd(C, dt=dt).view(1, 1, C),  # [C]
    "batch": lambda dt: _rnd(B, 1, C, dt=dt),  # [B, 1, C]
    "batch_stride0": lambda dt: _rnd(1, 1, C, dt=dt).expand(B, 1, C),
    "token": lambda dt: _rnd(B, L, C, dt=dt),  # [B, L, C] (Wan2.2 TI2V)
    "frame": lambda dt: _rnd(B, FRAMES, 1, C, dt=dt).view(B, FRAMES, C),  # [B, F, 1, C]
    "token_col_stride": lambda dt: _rnd(B, L, 2 * C, dt=dt)[..., ::2],
    "token_row_slice": lambda dt: _rnd(B, L, 2 * C, dt=dt)[..., C:],
}

# (activation dtype, modulation dtype)
_DTYPES = [
    (BF16, FP32),
    (BF16, BF16),
    (FP16, FP32),
    (FP16, FP16),
    (FP32, FP32),
    (FP32, BF16),
    (BF16, FP16),  # promotes to fp32 in eager
]


def _ids(pairs):
    return [f"{str(a)[6:]}-{str(m)[6:]}" for a, m in pairs]


def modulation(kind: str, dtype: torch.dtype) -> torch.Tensor:
    return _MODULATIONS[kind](dtype)


def full(m: torch.Tensor | None) -> torch.Tensor | None:
    """A [Bm, G, C] modulation as the [B, L, C] tensor eager broadcasting would use."""
    if m is None:
        return None
    if m.shape[1] > 1:
        m = m.repeat_interleave(L // m.shape[1], dim=1)
    return m.expand(B, L, C)


def eager_gated_residual(residual, x, gate):
    update = x if gate is None else x * full(gate)
    return (residual.float() + update).to(residual.dtype)


def eager_layer_norm_scale_shift(x, weight, bias, scale, shift, out_dtype=None):
    w = None if weight is None else weight.float()
    b = None if bias is None else bias.float()
    y = F.layer_norm(x.float(), (C,), w, b, EPS) * (1 + full(scale)) + full(shift)
    return y.to(out_dtype or x.dtype)


def activations(dtype: torch.dtype):
    return torch.randn(B, L, C, dtype=dtype) * 2, torch.randn(B, L, C, dtype=dtype)


@pytest.mark.parametrize("kind", [None, *_MODULATIONS])
@pytest.mark.parametrize(("dtype", "mdtype"), _DTYPES, ids=_ids(_DTYPES))
def test_gated_residual_is_bitwise_eager(kind, dtype, mdtype):
    torch.manual_seed(0)
    residual, x = activations(dtype)
    gate = None if kind is None else modulation(kind, mdtype)
    out = tmod.gated_residual(residual, x, gate)
    expected = eager_gated_residual(residual, x, gate)
    assert out.dtype == dtype and torch.equal(out, expected)


@pytest.mark.parametrize("kind", list(_MODULATIONS))
@pytest.mark.parametrize(("dtype", "mdtype"), _DTYPES, ids=_ids(_DTYPES))
def test_layer_norm_scale_shift(kind, dtype, mdtype):
    torch.manual_seed(1)
    x, _ = activations(dtype)
    scale = modulation(kind, mdtype)
    shift = modulation("token" if kind != "token" else "batch", mdtype)
    out = tmod.layer_norm_scale_shift(x, None, None, scale, shift, EPS)
    assert_matches(out, eager_layer_norm_scale_shift(x, None, None, scale, shift))


@pytest.mark.parametrize("affine", ["none", "fp32", "low", "weight_only"])
@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_layer_norm_scale_shift_affine(affine, dtype):
    torch.manual_seed(2)
    x, _ = activations(dtype)
    weight, bias = make_affine(C, affine, dtype)
    scale, shift = modulation("batch", FP32), modulation("token", FP32)
    out = tmod.layer_norm_scale_shift(x, weight, bias, scale, shift, EPS)
    assert_matches(out, eager_layer_norm_scale_shift(x, weight, bias, scale, shift))


@pytest.mark.parametrize(("dtype", "out_dtype"), [(BF16, FP32), (FP32, BF16), (FP16, BF16)])
def test_layer_norm_scale_shift_out_dtype(dtype, out_dtype):
    torch.manual_seed(3)
    x, _ = activations(dtype)
    scale, shift = modulation("frame", BF16), modulation("vector", FP32)
    out = tmod.layer_norm_scale_shift(x, None, None, scale, shift, EPS, out_dtype=out_dtype)
    assert_matches(out, eager_layer_norm_scale_shift(x, None, None, scale, shift, out_dtype))


@pytest.mark.parametrize("kind", [None, "scalar", "batch", "token", "frame", "token_col_stride"])
@pytest.mark.parametrize(("dtype", "mdtype"), _DTYPES, ids=_ids(_DTYPES))
def test_scale_residual_layer_norm_scale_shift(kind, dtype, mdtype):
    torch.manual_seed(4)
    residual, x = activations(dtype)
    gate = None if kind is None else modulation(kind, mdtype)
    scale, shift = modulation("batch", mdtype), modulation("token", mdtype)
    weight, bias = make_affine(C, "fp32", dtype)
    out, new_residual = tmod.scale_residual_layer_norm_scale_shift(
        residual, x, gate, weight, bias, scale, shift, EPS
    )
    expected_residual = eager_gated_residual(residual, x, gate)
    assert torch.equal(new_residual, expected_residual)
    expected = eager_layer_norm_scale_shift(expected_residual, weight, bias, scale, shift)
    assert_matches(out, expected)


def test_fused_normalises_the_rounded_residual():
    """Wan normalises the residual after rounding it to bf16: an fp32 output shows it."""
    torch.manual_seed(5)
    residual, x = activations(BF16)
    gate, scale, shift = (modulation(k, FP32) for k in ("batch", "batch", "batch"))
    out, new_residual = tmod.scale_residual_layer_norm_scale_shift(
        residual, x, gate, None, None, scale, shift, EPS, out_dtype=FP32
    )
    expected = eager_layer_norm_scale_shift(new_residual, None, None, scale, shift, FP32)
    assert_matches(out, expected)
    unrounded = (residual.float() + x * full(gate)).float()
    wrong = eager_layer_norm_scale_shift(unrounded, None, None, scale, shift, FP32)
    assert not torch.allclose(out, wrong, rtol=1e-5, atol=1e-5)


def test_strided_activations():
    torch.manual_seed(6)
    residual = torch.randn(L, B, C, dtype=BF16).transpose(0, 1)  # transposed leading dims
    x = torch.randn(B, L, 3 * C, dtype=BF16)[..., C : 2 * C]  # a slice of wider rows
    gate, scale, shift = (
        modulation("token", FP32),
        modulation("batch", FP32),
        modulation("frame", FP32),
    )
    assert torch.equal(
        tmod.gated_residual(residual, x, gate), eager_gated_residual(residual, x, gate)
    )
    out = tmod.layer_norm_scale_shift(x, None, None, scale, shift, EPS)
    assert_matches(out, eager_layer_norm_scale_shift(x, None, None, scale, shift))
    out, new_residual = tmod.scale_residual_layer_norm_scale_shift(
        residual, x, gate, None, None, scale, shift, EPS
    )
    expected_residual = eager_gated_residual(residual, x, gate)
    assert torch.equal(new_residual, expected_residual)
    assert_matches(out, eager_layer_norm_scale_shift(expected_residual, None, None, scale, shift))


@pytest.mark.parametrize("fused", [False, True])
def test_looped_path_for_wide_rows(fused):
    """Rows wider than the block loop over chunks (forced here with a small block)."""
    torch.manual_seed(7)
    residual, x = activations(BF16)
    gate, scale, shift = (
        modulation("token", BF16),
        modulation("frame", FP32),
        modulation("scalar", FP32),
    )
    weight, bias = make_affine(C, "low", BF16)
    out = torch.empty_like(x)
    if fused:
        new_residual = torch.empty_like(x)
        tln.launch_layer_norm(
            x,
            out,
            weight,
            bias,
            EPS,
            residual=residual,
            gate=gate,
            new_residual=new_residual,
            scale=scale,
            shift=shift,
            max_block_c=32,
        )
        expected_residual = eager_gated_residual(residual, x, gate)
        assert torch.equal(new_residual, expected_residual)
        normalised = expected_residual
    else:
        tln.launch_layer_norm(x, out, weight, bias, EPS, scale=scale, shift=shift, max_block_c=32)
        normalised = x
    assert_matches(out, eager_layer_norm_scale_shift(normalised, weight, bias, scale, shift))


def test_empty_inputs():
    x = torch.empty(B, 0, C, dtype=BF16)
    m = torch.zeros(1, 1, C)
    assert tmod.gated_residual(x, x, m).shape == x.shape
    assert tmod.layer_norm_scale_shift(x, None, None, m, m, EPS).shape == x.shape
    out, new_residual = tmod.scale_residual_layer_norm_scale_shift(
        x, x, None, None, None, m, m, EPS
    )
    assert out.shape == new_residual.shape == x.shape


def test_bad_inputs():
    x = torch.randn(B, L, C)
    m = torch.zeros(1, 1, C)
    with pytest.raises(ValueError, match=r"G dividing L=6"):
        tmod.layer_norm_scale_shift(x, None, None, torch.zeros(B, 4, C), m, EPS)
    with pytest.raises(ValueError, match=r"Bm in \(1, 2\)"):
        tmod.gated_residual(x, x, torch.zeros(3, 1, C))
    with pytest.raises(ValueError, match="3-D"):
        tmod.gated_residual(x[0], x[0], None)
    with pytest.raises(ValueError, match="residual's shape"):
        tmod.gated_residual(x, x[:, :3], None)
    with pytest.raises(TypeError, match="int32"):
        tmod.layer_norm_scale_shift(x, None, None, m.int(), m, EPS)
    with pytest.raises(TypeError, match="out_dtype"):
        tmod.layer_norm_scale_shift(x, None, None, m, m, EPS, out_dtype=torch.float64)


def test_custom_ops_are_registered_with_fakes():
    """torch.compile sees opaque ops; opcheck runs the fake and schema checks."""
    x, m = torch.randn(B, L, 7), torch.randn(1, 1, 7)
    checks = ("test_schema", "test_faketensor")
    torch.library.opcheck(
        torch.ops.ditops.triton_layer_norm_scale_shift.default,
        (x, None, None, m, m, EPS, torch.bfloat16),
        test_utils=checks,
    )
    torch.library.opcheck(
        torch.ops.ditops.triton_gated_residual.default, (x, x, m), test_utils=checks
    )
    torch.library.opcheck(
        torch.ops.ditops.triton_scale_residual_layer_norm_scale_shift.default,
        (x, x, None, None, None, m, m, EPS, None),
        test_utils=checks,
    )
