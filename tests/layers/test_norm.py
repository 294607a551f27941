"""FP32LayerNorm, the layer: an nn.LayerNorm with the same state dict, built from modules,
its weights seen as edited, moved or loaded, gradients, threads and compile.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from ditops import config
from ditops.layers.norm import FP32LayerNorm
from tests.ops.test_layer_norm import diffusers_meaning, make, native
from tests.precision import assert_exact


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


def test_torch_compile_model_holding_the_op() -> None:
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(64, 64), FP32LayerNorm(64, eps=1e-6)).to(torch.bfloat16)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    with torch.no_grad(), config.override(precision="exact"):
        eager = model(x)
        compiled = torch.compile(model, fullgraph=True)(x)
    assert_exact(compiled, eager)
