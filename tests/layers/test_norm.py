"""FP32LayerNorm: every path against forward_native, the weight cache, drop-in behaviour.

The NPU path runs against the test doubles of the legacy ``attentions`` package
(tests/doubles/npu_attentions.py, a CPU implementation of the documented
``attentions.layernorm`` contract) and of the current ``sgl_kernel_npu``, which has no
layer norm (tests/doubles/npu_sgl_kernel.py); the Triton path runs on CPU tensors
through Triton's interpreter (TRITON_INTERPRET=1, set in conftest.py).
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from torch import nn

import ditops
from ditops import config
from ditops.custom_op import BackendUnavailableError, reset_state
from ditops.layers.norm import FP32LayerNorm
from tests.doubles.npu_attentions import fake_attentions, no_attentions
from tests.doubles.npu_sgl_kernel import fake_sgl_kernel_npu
from tests.precision import assert_exact, assert_fast

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
AFFINE = ["affine", "no_bias", "none"]


def make(
    c: int | tuple[int, ...], affine: str, param_dtype: torch.dtype = torch.float32
) -> FP32LayerNorm:
    m = FP32LayerNorm(c, eps=1e-6, elementwise_affine=affine != "none", bias=affine == "affine")
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p))
    return m.to(param_dtype)


def native(m: FP32LayerNorm, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return m.forward_native(x)


def diffusers_meaning(m: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """The expression of diffusers' FP32LayerNorm, written out."""
    w = None if m.weight is None else m.weight.float()
    b = None if m.bias is None else m.bias.float()
    return torch.nn.functional.layer_norm(x.float(), m.normalized_shape, w, b, m.eps).to(x.dtype)


#: The fast contract of fp32_layer_norm (README): 1 ulp, or 1e-5 absolute where the affine
#: transform cancels to near 0, on at most 1e-3 of the elements.
LN_ATOL = 1e-5


def check(out: torch.Tensor, ref: torch.Tensor, precision: str) -> None:
    if precision == "exact":
        assert_exact(out, ref)
    else:
        assert_fast(out, ref, atol=LN_ATOL)


@pytest.mark.parametrize("precision", ["exact", "fast"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine", AFFINE)
@pytest.mark.parametrize(
    "shape", [(7,), (1, 1), (3, 1000), (2, 3, 5120), (2, 2, 3, 7), (2, 16384)], ids=str
)
def test_cpu_matches_native(
    shape: tuple[int, ...], affine: str, dtype: torch.dtype, precision: str
) -> None:
    m = make(shape[-1], affine)
    x = torch.randn(shape).to(dtype) * 3 + 1
    with torch.no_grad(), config.override(precision=precision):
        out = m(x)
    ref = native(m, x)
    assert_exact(ref, diffusers_meaning(m, x))
    check(out, ref, precision)
    assert out.shape == x.shape and out.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_fast_differs_on_few_elements(dtype: torch.dtype) -> None:
    # The rate half of the fast contract, on enough elements to measure it.
    m = make(1024, "affine")
    x = torch.randn(1024, 1024).to(dtype) * 3 + 1
    with torch.no_grad(), config.override(precision="fast"):
        assert_fast(m(x), native(m, x), max_ulp=1, max_fraction=1e-3, slack=0, atol=LN_ATOL)


@pytest.mark.parametrize("precision", ["exact", "fast"])
@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params(precision: str, param_dtype: torch.dtype) -> None:
    # model.to(bf16) casts the norm's parameters too; the meaning upcasts them.
    m = make(1000, "affine", param_dtype)
    x = torch.randn(64, 1000, dtype=param_dtype)
    with torch.no_grad(), config.override(precision=precision):
        check(m(x), native(m, x), precision)


@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_strided_inputs(precision: str) -> None:
    m = make(96, "affine")
    wide = torch.randn(16, 200, dtype=torch.bfloat16)
    sliced = wide[:, 50:146]  # row stride 200
    transposed = torch.randn(96, 8, 5, dtype=torch.bfloat16).permute(1, 2, 0)  # last dim strided
    every_other = torch.randn(32, 96, dtype=torch.bfloat16)[::2]
    with torch.no_grad(), config.override(precision=precision):
        for x in (sliced, transposed, every_other):
            assert not x.is_contiguous()
            check(m(x), native(m, x), precision)


def test_multi_dim_normalized_shape() -> None:
    m = make((4, 25), "affine")
    x = torch.randn(3, 4, 25, dtype=torch.bfloat16)
    with torch.no_grad(), config.override(precision="exact"):
        assert_exact(m(x), native(m, x))


@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_nan_inf_and_empty_like_native(precision: str) -> None:
    m = make(16, "affine")
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    with torch.no_grad(), config.override(precision=precision):
        out = m(x)
        assert_exact(out.isnan(), native(m, x).isnan())
        assert out[0].isfinite().all() and out[3].isfinite().all()
        empty = torch.empty(0, 16, dtype=torch.bfloat16)
        assert m(empty).shape == (0, 16)


def test_bad_inputs() -> None:
    m = make(8, "affine")
    with pytest.raises(TypeError, match="torch.int64 is not a floating point"):
        m(torch.ones(2, 8, dtype=torch.long))
    with pytest.raises(TypeError, match="torch.bool"):
        m(torch.ones(2, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"expected trailing dims \(8,\), got \(9,\)"):
        m(torch.ones(2, 9))
    with pytest.raises(ValueError, match="normalized_shape"):
        make((2, 8), "none")(torch.ones(8))


# --- drop-in behaviour -----------------------------------------------------------------


def test_is_layernorm_with_same_state_dict_keys() -> None:
    ours = FP32LayerNorm(32, eps=1e-6)
    ref = nn.LayerNorm(32, eps=1e-6)
    assert isinstance(ours, nn.LayerNorm)
    assert list(ours.state_dict()) == list(ref.state_dict()) == ["weight", "bias"]
    assert list(FP32LayerNorm(32, bias=False).state_dict()) == ["weight"]
    assert list(FP32LayerNorm(32, elementwise_affine=False).state_dict()) == []


def test_state_dict_round_trip_with_nn_layernorm() -> None:
    ref = nn.LayerNorm(32)
    nn.init.normal_(ref.weight)
    nn.init.normal_(ref.bias)
    ours = FP32LayerNorm(32)
    ours.load_state_dict(ref.state_dict())
    back = nn.LayerNorm(32)
    back.load_state_dict(ours.state_dict())
    assert torch.equal(back.weight, ref.weight) and torch.equal(back.bias, ref.bias)
    x = torch.randn(4, 32)
    with torch.no_grad():
        assert_exact(ours(x), ref(x))


def test_state_dict_round_trip_with_diffusers_fp32_layernorm() -> None:
    from diffusers.models.normalization import FP32LayerNorm as DiffusersFP32LayerNorm

    ref = DiffusersFP32LayerNorm(64, eps=1e-6, elementwise_affine=True).to(torch.bfloat16)
    with torch.no_grad():
        ref.weight.normal_()
        ref.bias.normal_()
    ours = FP32LayerNorm(64, eps=1e-6).to(torch.bfloat16)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(2, 10, 64, dtype=torch.bfloat16)
    with torch.no_grad(), config.override(precision="exact"):
        assert_exact(ours(x), ref(x))
    converted = FP32LayerNorm.from_module(ref)
    assert converted.weight is ref.weight and converted.bias is ref.bias
    assert converted.eps == ref.eps and converted.normalized_shape == ref.normalized_shape
    with torch.no_grad(), config.override(precision="exact"):
        assert_exact(converted(x), ref(x))
    ref.load_state_dict(ours.state_dict())


def test_from_module_rejects_other_modules() -> None:
    with pytest.raises(TypeError, match="expects an nn.LayerNorm"):
        FP32LayerNorm.from_module(nn.Linear(2, 2))  # type: ignore[arg-type]


# --- fp32 weights: cast per call, never stale --------------------------------------------


def test_fp32_params_are_used_as_they_are() -> None:
    m = make(16, "affine")
    with torch.no_grad():
        call = m._call(torch.ones(2, 16))
    assert call.weight is m.weight and call.bias is m.bias


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("custom_ops", ["all", "none"])
@pytest.mark.parametrize("precision", ["fast", "exact"])
def test_weights_edited_through_data_are_seen(
    dtype: torch.dtype, custom_ops: str, precision: str
) -> None:
    # Regression: a cache keyed on (data_ptr, _version) kept the old fp32 copy after an
    # edit through .data (LoRA fusing does that), on every path.
    m = make(256, "affine", dtype)
    x = torch.randn(4, 256, dtype=dtype)
    with torch.no_grad(), config.override(custom_ops=custom_ops, precision=precision):
        before = m(x)
        m.weight.data.mul_(2.0)
        m.bias.data.add_(1.0)
        after = m(x)
        assert not torch.equal(before, after)
        if precision == "exact":
            assert_exact(after, diffusers_meaning(m, x))
        assert torch.equal(m.forward_native(x), diffusers_meaning(m, x))
        m.weight.data = torch.full_like(m.weight, 3.0)  # a new tensor behind .data
        assert torch.equal(m.forward_native(x), diffusers_meaning(m, x))


def test_weights_follow_load_state_dict_and_to() -> None:
    m = make(16, "affine", torch.bfloat16)
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        m.load_state_dict({"weight": torch.ones(16), "bias": torch.zeros(16)})
        assert torch.equal(m._call(x.float()).weight, torch.ones(16))
        m.to(torch.float16)
        w = m._call(x.half()).weight
        assert w.dtype == torch.float32 and torch.equal(w, m.weight.float())
        assert_exact(m(x.half()), diffusers_meaning(m, x.half()))
    assert set(m.state_dict()) == {"weight", "bias"}


def test_a_callers_device_mistake_leaves_the_fast_path_on(ditops_warnings) -> None:
    # Regression: a norm built on the meta device called with a CPU tensor raised (fine),
    # then every FP32LayerNorm in the process ran forward_native.
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    on_meta = FP32LayerNorm(64, device="meta")
    for strict in (False, True):
        with torch.no_grad(), config.override(strict=strict):
            with pytest.raises((RuntimeError, ValueError), match="meta") as info:
                on_meta(x)  # refused when prepared (ValueError), as the other ops do
            assert not isinstance(info.value, BackendUnavailableError)
    other = make(64, "affine", torch.bfloat16)
    with torch.no_grad():
        assert other.explain_call(x).chosen == "forward_cpu"
        assert_fast(other(x), native(other, x))
    assert ditops_warnings() == []


def test_grad_reaches_weights() -> None:
    m = make(16, "affine", torch.bfloat16)
    x = torch.randn(3, 16, dtype=torch.bfloat16, requires_grad=True)
    out = m(x)  # grad enabled: native path
    out.float().sum().backward()
    assert m.weight.grad is not None and m.weight.grad.abs().sum() > 0
    assert x.grad is not None
    d = m.explain_call(x)
    assert d.chosen == "forward_native" and any("grad" in r for r in d.candidates[0].reasons)


def test_two_threads_share_a_module() -> None:
    m = make(512, "affine", torch.bfloat16)
    xs = [torch.randn(64, 512, dtype=torch.bfloat16) for _ in range(2)]
    refs = [native(m, x) for x in xs]
    m.precision = "exact"
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            with torch.no_grad():
                for _ in range(20):
                    assert_exact(m(xs[i]), refs[i])
        except BaseException as exc:  # noqa: BLE001 - surfaced in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


# --- torch.compile ---------------------------------------------------------------------


def test_torch_compile_model_holding_the_op() -> None:
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(64, 64), FP32LayerNorm(64, eps=1e-6)).to(torch.bfloat16)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    with torch.no_grad(), config.override(precision="exact"):
        eager = model(x)
        compiled = torch.compile(model, fullgraph=True)(x)
    assert_exact(compiled, eager)


# --- the NPU path, through the test double ----------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine", AFFINE)
def test_npu_path_matches_native(
    on_npu: None, affine: str, dtype: torch.dtype, caplog, ditops_warnings
) -> None:
    m = make(1000, affine, dtype)
    x = torch.randn(2, 5, 1000, dtype=dtype)
    with fake_attentions() as calls, torch.no_grad():
        out = m(x)
        assert ditops.explain("fp32_layer_norm", ["npu"])[0].chosen == "forward_npu"
    assert_fast(out, native(m, x), atol=LN_ATOL)
    assert not ditops_warnings()
    (args,) = calls.of("layernorm")
    inp, shape, w, b, eps, impl_mode = args
    assert inp.dtype == dtype and shape == [1000] and eps == pytest.approx(1e-6) and impl_mode == 0
    for p in (w, b):
        assert p is None or p.dtype == torch.float32
    assert (w is None) == (affine == "none") and (b is None) == (affine != "affine")


def test_npu_exact_precision_runs_native(on_npu: None) -> None:
    m = make(64, "affine", torch.bfloat16)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with fake_attentions() as calls, torch.no_grad(), config.override(precision="exact"):
        assert_exact(m(x), native(m, x))
    assert calls.calls == []


def npu_norm_choice() -> str:
    """What ``ditops info`` says the NPU path of fp32_layer_norm takes."""
    (candidate,) = ditops.explain("fp32_layer_norm", ["npu"])[0].candidates
    return candidate.accepts


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine", AFFINE)
def test_npu_without_a_layernorm_kernel_runs_f_layer_norm_through_torch_npu(
    on_npu: None, affine: str, dtype: torch.dtype, ditops_warnings
) -> None:
    # The current sgl_kernel_npu has no layer norm: F.layer_norm of the NPU tensor with fp32
    # weight and bias (ATen's mixed-dtype kernel stands in for torch_npu's here).
    m = make(1000, affine, dtype)
    x = torch.randn(2, 5, 1000, dtype=dtype)
    with fake_sgl_kernel_npu() as calls, torch.no_grad():
        assert m.explain_call(x).chosen == "forward_npu"
        out = m(x)
        choice = npu_norm_choice()
    assert_fast(out, native(m, x), atol=LN_ATOL)
    assert calls.calls == [] and not ditops_warnings()
    assert "torch_npu: F.layer_norm with fp32 weight and bias" in choice
    assert "sgl_kernel_npu: ships none; attentions: not installed" in choice


def test_npu_prefers_the_legacy_layernorm_kernel_to_torch_npu(on_npu: None) -> None:
    m = make(64, "affine", torch.bfloat16)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with fake_sgl_kernel_npu(), fake_attentions() as calls, torch.no_grad():
        out = m(x)
        choice = npu_norm_choice()
    assert_fast(out, native(m, x), atol=LN_ATOL)
    assert len(calls.of("layernorm")) == 1
    assert "needs attentions: torch.ops.attentions.layernorm, impl_mode 0" in choice


def test_npu_layer_norm_of_more_than_8_dims_runs_native(on_npu: None) -> None:
    m = make(4, "affine", torch.bfloat16)
    x = torch.randn(1, 1, 1, 1, 1, 1, 1, 2, 4, dtype=torch.bfloat16)
    with fake_attentions() as calls, torch.no_grad():
        decision = m.explain_call(x)
        assert_exact(m(x), native(m, x))
    assert decision.chosen == "forward_native"
    assert "9-D input: the NPU layer norm takes at most 8 dims" in decision.candidates[0].reasons
    assert calls.calls == []


@pytest.mark.parametrize("case", ["not_installed", "op_missing", "raises"])
def test_npu_fallbacks_warn_once(
    on_npu: None, case: str, caplog: pytest.LogCaptureFixture, ditops_warnings
) -> None:
    m = make(64, "affine", torch.bfloat16)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    expected = {
        "not_installed": "the legacy 'attentions' package is not installed",
        "op_missing": "'attentions' package is installed but registers no "
        "torch.ops.attentions.layernorm",
        "raises": "fake attentions.layernorm failed at run time",
    }[case]
    setups = {
        "not_installed": no_attentions,
        "op_missing": lambda: fake_attentions(
            ops=[], extra_schemas={"layer_norm_v2": "(Tensor x) -> Tensor"}
        ),
        "raises": lambda: fake_attentions(raising={"layernorm"}),
    }
    with setups[case](), torch.no_grad(), caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert_exact(m(x), native(m, x))
        reasons = ditops.explain("fp32_layer_norm", ["npu"])[0].candidates[0].reasons
    warnings = ditops_warnings()
    assert len(warnings) == 1 and expected in warnings[0], warnings
    if case != "raises":  # no layer norm anywhere: every way to get one is named
        assert "sgl_kernel_npu has no layernorm kernel" in warnings[0]
        assert "torch_npu is not installed" in warnings[0]
        assert "install torch_npu for your CANN version" in warnings[0]
    assert any(expected in r for r in reasons)


@pytest.mark.parametrize("case", ["not_installed", "raises"])
def test_npu_strict_mode_raises(on_npu: None, case: str) -> None:
    m = make(64, "affine", torch.bfloat16)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    setup = no_attentions() if case == "not_installed" else fake_attentions(raising={"layernorm"})
    with setup, torch.no_grad(), config.override(strict=True):
        with pytest.raises(BackendUnavailableError, match="attentions"):
            m(x)


# --- the Triton path, through the interpreter ------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine", AFFINE)
@pytest.mark.parametrize("shape", [(7,), (3, 1000), (2, 2, 3, 100), (1, 16384)], ids=str)
def test_triton_path_matches_native(
    shape: tuple[int, ...], affine: str, dtype: torch.dtype
) -> None:
    m = make(shape[-1], affine, dtype if affine != "none" else torch.float32)
    x = torch.randn(shape, dtype=dtype)
    reset_state()
    with ditops.force_device_kind({"cpu": "cuda"}), torch.no_grad(), config.override(strict=True):
        assert m.explain_call(x).chosen == "forward_cuda"
        out = m(x)
    # The interpreter truncates fp32 -> low precision where a GPU rounds to nearest even:
    # hold it to 1 ulp on any number of elements (see the field notes).
    assert_fast(out, native(m, x), max_ulp=1, max_fraction=1.0, atol=LN_ATOL)
    assert out.shape == x.shape and out.dtype == dtype


def test_triton_path_strided_rows() -> None:
    m = make(100, "affine")
    x = torch.randn(6, 300, dtype=torch.bfloat16)[:, 100:200]
    with ditops.force_device_kind({"cpu": "cuda"}), torch.no_grad(), config.override(strict=True):
        out = m(x)
    assert_fast(out, native(m, x), max_ulp=1, max_fraction=1.0, atol=LN_ATOL)
