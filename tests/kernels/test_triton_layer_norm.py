"""The Triton fp32 LayerNorm, run on CPU through Triton's interpreter (tests/conftest.py).

The kernel rounds fp32 -> bf16 to nearest even by integer arithmetic (the interpreter's
own cast truncates), so low-precision outputs are held to 1 ulp of native on at most 1%
of the elements: truncation would fail that on about half of them. fp32 outputs differ
from native by a few fp32 ulps (another summation order): a small absolute/relative
tolerance. Shapes are tiny: the interpreter is slow.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ditops.kernels.triton import layer_norm as tln
from tests.precision import ulp_distance

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def assert_matches(
    actual: torch.Tensor, expected: torch.Tensor, atol: float = 1e-5, max_fraction: float = 1e-2
):
    """Same shape and dtype, NaN at the same places, and close to native.

    fp32: a small relative/absolute tolerance. Low precision: each element within 1 ulp
    or within ``atol`` (outputs near zero: the fp32 statistics of two implementations
    differ by ~``2**-24 * |mean| / std`` absolute, many ulps of a tiny value), and at most
    ``max_fraction`` of the elements differ at all.
    """
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    nan = expected.isnan()
    assert torch.equal(actual.isnan(), nan), "NaN in different places"
    if expected.dtype == FP32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=atol, equal_nan=True)
        return
    dist = ulp_distance(actual, expected)[~nan]
    diff = (actual.float() - expected.float()).abs()[~nan]
    far = (dist > 1) & ~(diff <= atol)
    assert not far.any(), f"{int(far.sum())} elements off by more than 1 ulp and {atol}"
    fraction = float((dist > 0).float().mean()) if dist.numel() else 0.0
    assert fraction <= max_fraction, f"{fraction:.4f} of the elements differ by 1 ulp"


def native(x, weight, bias, eps):
    """The meaning: fp32 LayerNorm rounded once to x's dtype."""
    w = None if weight is None else weight.float()
    b = None if bias is None else bias.float()
    return F.layer_norm(x.float(), (x.shape[-1],), w, b, eps).to(x.dtype)


def make_affine(c: int, kind: str, dtype: torch.dtype):
    """(weight, bias) for an affine kind: fp32, low (x's dtype), weight_only, none."""
    if kind == "none":
        return None, None
    wdt = FP32 if kind in ("fp32", "weight_only") else dtype
    weight = (1 + 0.5 * torch.randn(c)).to(wdt)
    bias = None if kind == "weight_only" else torch.randn(c).to(wdt)
    return weight, bias


@pytest.mark.parametrize(
    ("shape", "dtype", "affine"),
    [
        ((7,), BF16, "fp32"),
        ((5, 1), FP32, "fp32"),
        ((3, 1), BF16, "none"),
        ((3, 100), FP16, "low"),
        ((4, 100), BF16, "low"),
        ((3, 100), FP32, "none"),
        ((2, 3, 1000), BF16, "none"),
        ((2, 1000), FP16, "fp32"),
        ((2, 1000), FP32, "weight_only"),
        ((2, 2, 3, 7), FP32, "fp32"),
        ((2, 2, 3, 7), BF16, "weight_only"),
        ((1, 16384), BF16, "fp32"),
    ],
)
def test_matches_native(shape, dtype, affine):
    torch.manual_seed(0)
    x = (torch.randn(shape) * 3 + 5).to(dtype)
    weight, bias = make_affine(shape[-1], affine, dtype)
    out = tln.fp32_layer_norm(x, weight, bias, 1e-6)
    assert_matches(out, native(x, weight, bias, 1e-6))


_STRIDED = {
    # row stride 130 (a slice of a wider tensor): one strided row dim
    "slice": lambda dt: torch.randn(6, 130, dtype=dt)[:, 10:110],
    # a transposed leading dim: two row dims the kernel walks with their strides
    "transposed": lambda dt: torch.randn(4, 3, 100, dtype=dt).transpose(0, 1),
    # a slice along the third dim of a 4-D tensor: dims 0 and 1 merge
    "merge": lambda dt: torch.randn(2, 3, 8, 7, dtype=dt)[:, :, 2:6],
    # three non-mergeable row dims: copied
    "permuted": lambda dt: torch.randn(2, 3, 4, 7, dtype=dt).permute(2, 1, 0, 3),
    # last dim not contiguous: copied
    "column_stride": lambda dt: torch.randn(100, 5, dtype=dt).t(),
}


@pytest.mark.parametrize("name", list(_STRIDED))
@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_strided_rows(name, dtype):
    torch.manual_seed(1)
    x = _STRIDED[name](dtype)
    assert not x.is_contiguous()
    weight, bias = make_affine(x.shape[-1], "fp32", dtype)
    assert_matches(tln.fp32_layer_norm(x, weight, bias, 1e-5), native(x, weight, bias, 1e-5))


def test_row_view_merges_without_copy():
    base = torch.randn(2, 3, 8, 7)
    x = base[:, :, 2:6]  # [2, 3, 4, 7]: dims 0 and 1 merge (stride 168 = 3 * 56)
    view, length, stride_b, stride_l = tln.row_view(x)
    assert view.data_ptr() == x.data_ptr()
    assert (length, stride_b, stride_l) == (4, 56, 7)
    t = torch.randn(4, 3, 100).transpose(0, 1)
    view, length, stride_b, stride_l = tln.row_view(t)
    assert view.data_ptr() == t.data_ptr() and (length, stride_b, stride_l) == (4, 100, 300)
    p = torch.randn(2, 3, 4, 7).permute(2, 0, 1, 3)  # strides (7, 84, 28): the last two merge
    view, length, stride_b, stride_l = tln.row_view(p)
    assert view.data_ptr() == p.data_ptr() and (length, stride_b, stride_l) == (6, 7, 28)
    q = torch.randn(2, 3, 4, 7).permute(2, 1, 0, 3)  # strides (7, 28, 84): nothing merges
    view, length, stride_b, stride_l = tln.row_view(q)
    assert view.is_contiguous() and (length, stride_b, stride_l) == (24, 0, 7)


@pytest.mark.parametrize(("c", "dtype", "affine"), [(100, FP32, "fp32"), (1000, BF16, "low")])
def test_looped_path_for_wide_rows(c, dtype, affine):
    """Rows wider than the block loop over chunks (forced here with a small block)."""
    torch.manual_seed(2)
    x = (torch.randn(3, c) * 2 + 20).to(dtype)
    weight, bias = make_affine(c, affine, dtype)
    assert tln.launch_config(3, c, 32)[2], "the looped path was not chosen"
    out = torch.empty_like(x)
    tln.launch_layer_norm(x, out, weight, bias, 1e-6, max_block_c=32)
    assert_matches(out, native(x, weight, bias, 1e-6), atol=2e-5)


def test_large_mean_is_stable():
    """Two-pass statistics: a large mean does not cancel the variance away."""
    torch.manual_seed(3)
    x = torch.randn(4, 1000) * 0.01 + 3000.0
    expected = F.layer_norm(x.double(), (1000,), eps=1e-6).float()
    torch.testing.assert_close(
        tln.fp32_layer_norm(x, None, None, 1e-6), expected, rtol=0, atol=2e-2
    )


@pytest.mark.parametrize("shape", [(0, 7), (2, 0, 5), (3, 0)])
def test_empty(shape):
    out = tln.fp32_layer_norm(torch.empty(shape, dtype=BF16), None, None, 1e-5)
    assert out.shape == shape and out.dtype == BF16


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy's inf - inf
def test_nan_and_inf_rows_behave_as_native():
    x = torch.randn(4, 7)
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    assert_matches(tln.fp32_layer_norm(x, None, None, 1e-5), native(x, None, None, 1e-5))


def test_bad_inputs():
    with pytest.raises(TypeError, match="int64"):
        tln.fp32_layer_norm(torch.ones(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"expected \(3,\)"):
        tln.fp32_layer_norm(torch.ones(2, 3), torch.ones(4))
    with pytest.raises(ValueError, match="scalar"):
        tln.fp32_layer_norm(torch.tensor(1.0))


def test_custom_op_is_registered_with_a_fake():
    """torch.compile sees one opaque op; opcheck runs the fake and schema checks."""
    x = torch.randn(3, 7)
    torch.library.opcheck(
        torch.ops.ditops.triton_fp32_layer_norm.default,
        (x, torch.randn(7), None, 1e-5),
        test_utils=("test_schema", "test_faketensor"),
    )


@pytest.mark.parametrize("row_kernel", [True, False], ids=["row_kernel", "tile_kernel"])
@pytest.mark.parametrize(
    ("shape", "dtype", "affine"),
    [
        ((3, 2048), BF16, "fp32"),
        ((2, 3000), FP16, "low"),
        ((2, 2, 5120), BF16, "weight_only"),
        ((4, 5120), FP32, "none"),
    ],
)
def test_one_row_per_program_both_kernels(
    monkeypatch: pytest.MonkeyPatch, shape, dtype, affine, row_kernel: bool
):
    # Rows of 2048+ elements run one per program: the 1-D row kernel, or the 2-D tile
    # kernel when it is switched off. Both must give the meaning, strided rows included.
    monkeypatch.setattr(tln, "ROW_KERNEL", row_kernel)
    torch.manual_seed(1)
    wide = (torch.randn(*shape[:-1], shape[-1] + 64) * 3 + 5).to(dtype)
    x = wide[..., 32 : 32 + shape[-1]]  # row stride larger than the row
    weight, bias = make_affine(shape[-1], affine, dtype)
    assert_matches(tln.fp32_layer_norm(x, weight, bias, 1e-6), native(x, weight, bias, 1e-6))
