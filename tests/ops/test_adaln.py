"""The adaLN-Zero ops in the model dtype (FLUX's arithmetic) on every path.

Exact is bitwise FLUX's eager expressions (``F.layer_norm(x) * (1 + scale) + shift``,
``residual + gate * x``, every step rounded to the model dtype); fast is within the
documented bound (1.5 ulps of ``|LN(x) * (1 + scale)|`` plus 1 ulp of the output, in
the model dtype) and its residuals are exact. The Triton path runs on CPU tensors
through Triton's interpreter (``force_device_kind({"cpu": "cuda"})``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import ditops
from ditops import config
from ditops.custom_op import reset_state
from ditops.ops.modulation_model_dtype import (
    adaln_modulate,
    adaln_residual,
    adaln_residual_modulate,
)
from tests.precision import assert_exact

B, L, C, FRAMES = 2, 12, 33, 4  # C odd: no vector-width assumption
EPS = 1e-6
_MANTISSA = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}


def _rnd(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.randn(*shape) * 0.5).to(dtype)


MODULATIONS = {
    "flux": lambda dt: _rnd(B, 1, C, dtype=dt),  # AdaLayerNormZero's [B, 1, C]
    "vector": lambda dt: _rnd(C, dtype=dt),
    "token": lambda dt: _rnd(B, L, C, dtype=dt),
    "frame": lambda dt: _rnd(B, FRAMES, 1, C, dtype=dt),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _framed(fn: Any, x: torch.Tensor, *mods: Any) -> torch.Tensor:
    """``fn`` on x viewed as ``[B, F, L/F, C]`` when a modulation is per frame."""
    if any(isinstance(m, torch.Tensor) and m.dim() == 4 for m in mods):
        return fn(x.unflatten(1, (FRAMES, -1))).flatten(1, 2)
    return fn(x)


def flux_modulate(x: torch.Tensor, scale: Any, shift: Any) -> torch.Tensor:
    """FLUX's expression, as diffusers writes it."""
    return _framed(
        lambda v: F.layer_norm(v, (C,), None, None, EPS) * (1 + scale) + shift, x, scale, shift
    )


def flux_residual(h: torch.Tensor, a: torch.Tensor, gate: Any) -> torch.Tensor:
    if isinstance(gate, torch.Tensor) and gate.dim() == 4:
        return (h.unflatten(1, (FRAMES, -1)) + gate * a.unflatten(1, (FRAMES, -1))).flatten(1, 2)
    return h + gate * a


def ulp(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of ``dtype`` at magnitude ``|v|`` (fp32 values)."""
    _, e = torch.frexp(v.abs().clamp_min(torch.finfo(dtype).tiny))
    return torch.ldexp(torch.ones_like(v), (e - 1 - _MANTISSA[dtype]).to(torch.int32))


def assert_within_fast_bound(
    out: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, scale: torch.Tensor
) -> None:
    """The fast contract: ``|out - ref| <= 1.5 ulp(|LN(x) * (1 + scale)|) + ulp(ref)``."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.equal(out.isnan(), ref.isnan())
    prod = _framed(
        lambda v: F.layer_norm(v, (C,), None, None, EPS) * (1 + scale.float()), x.float(), scale
    )
    bound = 1.5 * ulp(prod, out.dtype) + ulp(ref.float(), out.dtype)
    diff = (out.float() - ref.float()).abs()
    worst = float((diff / bound).max())
    assert worst <= 1.0, f"{worst:.2f} x the bound"


def _args(kind: str, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    h = torch.randn(B, L, C).to(dtype) * 2
    a = torch.randn(B, L, C).to(dtype)
    gate, scale, shift = (MODULATIONS[kind](dtype) for _ in range(3))
    return h, a, gate, scale, shift


@pytest.mark.parametrize("precision", ["exact", "fast"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kind", list(MODULATIONS))
def test_cpu_matches_flux_expressions(kind: str, dtype: str, precision: str) -> None:
    h, a, gate, scale, shift = _args(kind, DTYPES[dtype])
    with torch.no_grad(), config.override(precision=precision, strict=True):
        assert adaln_modulate.op.explain_call(h, scale, shift, EPS).chosen == "forward_cpu"
        res = flux_residual(h, a, gate)
        assert_exact(adaln_residual(h, a, gate), res)  # exact in both modes
        out, new = adaln_residual_modulate(h, a, gate, scale, shift, EPS)
        assert_exact(new, res)
        for got, x in ((adaln_modulate(h, scale, shift, EPS), h), (out, res)):
            want = flux_modulate(x, scale, shift)
            if precision == "exact" or DTYPES[dtype] == torch.float32:
                assert_exact(got, want)  # fp32 takes the exact kernel in both modes
            else:
                assert_within_fast_bound(got, want, x, scale)


def test_fast_rounds_once_so_it_differs() -> None:
    """The fast path is really another computation (so the exact tests above could fail)."""
    h, _, _, scale, shift = _args("flux", torch.bfloat16)
    with torch.no_grad(), config.override(precision="fast"):
        assert not torch.equal(adaln_modulate(h, scale, shift, EPS), flux_modulate(h, scale, shift))


def test_native_is_the_flux_expression_with_promotion() -> None:
    """Mixed dtypes (an fp32 scale on bf16 activations) promote as eager does; the fast
    paths decline them by name and the meaning runs."""
    h = torch.randn(B, L, C).bfloat16()
    scale, shift = _rnd(B, 1, C, dtype=torch.float32), _rnd(B, 1, C, dtype=torch.bfloat16)
    decision = adaln_modulate.op.explain_call(h, scale, shift, EPS)
    assert decision.chosen == "forward_native"
    assert "scale is float32 with bfloat16 activations" in " ".join(decision.candidates[0].reasons)
    out = adaln_modulate(h, scale, shift, EPS)
    assert out.dtype == torch.float32
    assert_exact(out, flux_modulate(h, scale, shift))
    assert_exact(adaln_residual(h, h, 0.5), h + 0.5 * h)  # a Python-number gate


def test_two_dim_strided_and_no_modulation() -> None:
    base = torch.randn(L, 2 * C).bfloat16()
    x = base[:, ::2]  # strided [L, C]
    with torch.no_grad(), config.override(precision="exact", strict=True):
        assert_exact(adaln_modulate(x, None, None, EPS), F.layer_norm(x, (C,), eps=EPS))
        assert_exact(adaln_residual(x, x), x + x)
        out, new = adaln_residual_modulate(x, x, None, None, None, EPS)
        assert_exact(new, x + x)
        assert_exact(out, F.layer_norm(x + x, (C,), eps=EPS))


def test_nan_and_inf_propagate_as_in_the_meaning() -> None:
    h, a, gate, scale, shift = _args("flux", torch.bfloat16)
    h[0, 3, 5] = float("nan")
    a[1, 2, 7] = float("inf")
    res = flux_residual(h, a, gate)
    for precision in ("exact", "fast"):
        with torch.no_grad(), config.override(precision=precision, strict=True):
            out, new = adaln_residual_modulate(h, a, gate, scale, shift, EPS)
            assert_exact(new, res)
            want = flux_modulate(res, scale, shift)
            assert torch.equal(out.isnan(), want.isnan())
            assert out[0, 3].isnan().all() and out[1, 2].isnan().all()


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: adaln_modulate(torch.randn(2, 3, 4), torch.randn(5), None), ValueError, "scale"),
        (lambda: adaln_residual(torch.randn(2, 3, 4), torch.randn(2, 3, 5)), ValueError, "shape"),
        (lambda: adaln_modulate(torch.randn(2, 3, 4), None, None, "1e-6"), TypeError, "eps"),
        (lambda: adaln_modulate(torch.randn(4), None, None), ValueError, "x"),
    ],
    ids=["scale_width", "residual_shape", "eps_type", "one_dim"],
)
def test_bad_input_is_explained(call: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        call()


# --- the Triton path, through the interpreter ---------------------------------------------


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kind", [*MODULATIONS, "none"])
def test_cpu_whole_tensor_residual_is_eager_bitwise(kind: str, dtype: str) -> None:
    """The second CPU path of adaln_residual (two ATen calls over the whole tensor, the
    product written into the output) gives eager's bits, inf and NaN included."""
    h, a, *_ = _args("flux", DTYPES[dtype])
    gate = None if kind == "none" else MODULATIONS[kind](DTYPES[dtype])
    h[0, 0, :3] = torch.tensor([float("inf"), float("nan"), -float("inf")])
    a[1, 2, :2] = torch.tensor([float("inf"), float("nan")])
    want = h + a if gate is None else flux_residual(h, a, gate)
    with torch.no_grad():
        got = adaln_residual.op.forward_cpu_whole(h, a, gate)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.isnan(), want.isnan())
    finite = ~want.isnan()
    assert torch.equal(got[finite], want[finite])
    assert_exact(got.nan_to_num(0.0), want.nan_to_num(0.0))


def _with_specials(h: torch.Tensor, a: torch.Tensor) -> None:
    h[0, 0, :3] = torch.tensor([float("inf"), float("nan"), -float("inf")])
    a[1, 2, :2] = torch.tensor([float("inf"), float("nan")])


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.isnan(), want.isnan())
    assert_exact(got.nan_to_num(0.0), want.nan_to_num(0.0))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kind", [*MODULATIONS, "none"])
def test_cpu_whole_tensor_modulate_is_eager_bitwise(kind: str, dtype: str) -> None:
    """The whole-tensor CPU paths of adaln_modulate and adaln_residual_modulate (eager's
    calls with the product and sum done in place: one output buffer, every intra-op
    thread) give eager's bits, inf and NaN included, with and without modulations."""
    h, a, gate, scale, shift = _args("flux" if kind == "none" else kind, DTYPES[dtype])
    if kind == "none":
        gate = scale = shift = None
    _with_specials(h, a)
    want = flux_modulate(h, 0 if scale is None else scale, 0 if shift is None else shift)
    with torch.no_grad():
        _same_bits(adaln_modulate.op.forward_cpu_whole(h, scale, shift, EPS), want)
        out, new = adaln_residual_modulate.op.forward_cpu_whole(h, a, gate, scale, shift, EPS)
    res = h + a if gate is None else flux_residual(h, a, gate)
    _same_bits(new, res)
    _same_bits(
        out, flux_modulate(res, 0 if scale is None else scale, 0 if shift is None else shift)
    )


def test_cpu_whole_tensor_paths_leave_inputs_alone() -> None:
    """In place means in the output buffer only: the inputs keep their values."""
    h, a, gate, scale, shift = _args("flux", torch.bfloat16)
    before = [t.clone() for t in (h, a, gate, scale, shift)]
    with torch.no_grad():
        adaln_modulate.op.forward_cpu_whole(h, scale, shift, EPS)
        adaln_residual_modulate.op.forward_cpu_whole(h, a, gate, scale, shift, EPS)
    for t, b in zip((h, a, gate, scale, shift), before, strict=True):
        assert torch.equal(t, b)


@pytest.fixture
def on_cuda() -> Any:
    reset_state()
    with ditops.force_device_kind({"cpu": "cuda"}), torch.no_grad(), config.override(strict=True):
        yield
    reset_state()


@pytest.mark.parametrize(
    ("kind", "dtype"), [("flux", "bf16"), ("token", "fp16"), ("frame", "fp32")]
)
def test_triton_path(on_cuda: None, kind: str, dtype: str) -> None:
    h, a, gate, scale, shift = _args(kind, DTYPES[dtype])
    assert adaln_modulate.op.explain_call(h, scale, shift, EPS).chosen == "forward_cuda"
    res = flux_residual(h, a, gate)
    assert_exact(adaln_residual(h, a, gate), res)  # eager's roundings
    out, new = adaln_residual_modulate(h, a, gate, scale, shift, EPS)
    assert_exact(new, res)
    for got, x in ((adaln_modulate(h, scale, shift, EPS), h), (out, res)):
        want = flux_modulate(x, scale, shift)
        if DTYPES[dtype] == torch.float32:
            prod = _framed(lambda v: F.layer_norm(v, (C,), eps=EPS) * (1 + scale), x, scale)
            assert float((got - want).abs().max()) <= 1e-5 * float(prod.abs().max())
        else:
            assert_within_fast_bound(got, want, x, scale)


def test_triton_without_modulation(on_cuda: None) -> None:
    x = torch.randn(L, C).bfloat16()
    got = adaln_modulate(x, None, None, EPS)
    assert_within_fast_bound(got, F.layer_norm(x, (C,), eps=EPS), x, torch.zeros(C))
