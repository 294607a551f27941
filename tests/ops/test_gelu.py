"""``gelu_tanh_bias``: the meaning, the Triton path (interpreter), the argument checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ditops
from ditops import config
from ditops.custom_op import reset_state
from ditops.ops.gelu import gelu_tanh_bias
from tests.precision import assert_exact, assert_fast

op = gelu_tanh_bias.op

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
DTYPES = [BF16, FP16, FP32]


def eager(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What the op means, written out."""
    h = x if bias is None else (x + bias).to(x.dtype)
    return F.gelu(h, approximate="tanh")


def inputs(shape, dtype, bias_dtype=None, scale=3.0):
    x = (torch.randn(shape) * scale).to(dtype)
    return x, torch.randn(shape[-1]).to(bias_dtype or dtype)


def test_native_is_the_eager_expression() -> None:
    x, b = inputs((5, 96), BF16)
    assert_exact(op.forward_native(x, b), F.gelu(x + b, approximate="tanh"))
    assert_exact(op.forward_native(x, None), F.gelu(x, approximate="tanh"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_finite_propagate_like_the_meaning(dtype) -> None:
    x, b = inputs((256, 4096), dtype)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -1e30, -0.0])
    x.view(-1)[::997][: 6 * 100] = special.repeat(100)[: x.view(-1)[::997].numel()].to(dtype)
    b[5] = float("inf")
    b[9] = float("nan")
    with ditops.force_device_kind({"cpu": "cuda"}), torch.no_grad(), config.override(strict=True):
        out = op(x[:4, :512], b[:512])
    ref = eager(x[:4, :512], b[:512])
    assert torch.equal(out.isnan(), ref.isnan())
    inf = ref.isinf()
    assert torch.equal(out.isinf(), inf) and torch.equal(out[inf], ref[inf])


def test_explain_says_cpu_runs_the_meaning_and_gpus_triton() -> None:
    # No CPU path: blocking eager's two calls measured no gain (benchmarks/cpu/probes/gelu.txt).
    (cpu,) = ditops.explain("gelu_tanh_bias", device_kinds=["cpu"])
    assert cpu.chosen == "forward_native" and "no cpu fast path" in cpu.candidates[0].reasons[0]
    for kind in ("cuda", "hip", "xpu"):
        (d,) = ditops.explain("gelu_tanh_bias", device_kinds=[kind])
        assert [c.path for c in d.candidates] == ["forward_cuda"]
    x, b = inputs((3, 8), BF16)
    assert op.explain_call(x, b).chosen == "forward_native"
    assert "gelu_tanh_bias" in ditops.registered_ops()
    assert ditops.gelu_tanh_bias.op is op


def test_grad_runs_the_meaning() -> None:
    x, b = inputs((3, 8), FP32)
    x.requires_grad_(True)
    with ditops.force_device_kind({"cpu": "cuda"}):
        d = op.explain_call(x, b)
        op(x, b).sum().backward()
    assert d.chosen == "forward_native" and any("grad" in r for r in d.candidates[0].reasons)
    assert x.grad is not None


# --- the Triton path, through the interpreter --------------------------------------------


def triton_tolerance(x: torch.Tensor, b: torch.Tensor | None) -> float:
    """Where eager's fp32 ``1 + tanh`` cancels (very negative inputs) it is itself only
    good to ``|h| * 2**-24`` absolute: allow twice that, beyond 1 ulp."""
    h = x.float() if b is None else (x + b).to(x.dtype).float()
    return float(h.abs().max()) * 2**-23


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("shape", "bias"),
    [((7,), "same"), ((3, 100), "same"), ((2, 3, 130), "fp32"), ((5, 64), None)],
    ids=str,
)
def test_triton_path_matches_native(shape, bias, dtype) -> None:
    x, b = inputs(shape, dtype, FP32 if bias == "fp32" else None)
    b = None if bias is None else b
    reset_state()
    with ditops.force_device_kind({"cpu": "cuda"}), torch.no_grad(), config.override(strict=True):
        assert op.explain_call(x, b).chosen == "forward_cuda"
        out = op(x, b)
    # fp32 shows the other tanh (a few fp32 ulps); bf16/fp16 round it away but for 1 ulp.
    max_ulp = 8 if dtype == FP32 else 1
    assert_fast(out, eager(x, b), max_ulp=max_ulp, max_fraction=1.0, atol=triton_tolerance(x, b))


def test_triton_path_strided_x_and_deep_negative_inputs() -> None:
    x = torch.linspace(-12, 12, 3 * 256).to(BF16).view(3, 256)
    b = torch.randn(256).to(BF16)
    xs = torch.randn(6, 512).to(BF16)[:, ::2]
    with ditops.force_device_kind({"cpu": "cuda"}), torch.no_grad(), config.override(strict=True):
        out, out_s = op(x, b), op(xs, b)
    assert_fast(out, eager(x, b), max_fraction=1.0, atol=triton_tolerance(x, b))
    assert_fast(out_s, eager(xs, b), max_fraction=1.0, atol=triton_tolerance(xs, b))


# --- bad inputs -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (([1.0, 2.0], None), TypeError, r"gelu_tanh_bias: x must be a tensor, got list"),
        (
            (torch.ones(3, dtype=torch.int32), None),
            TypeError,
            r"x dtype int32 not supported; expected",
        ),
        ((torch.ones(2, 4), [0.0] * 4), TypeError, r"bias must be a tensor, got list"),
        (
            (torch.ones(2, 4, dtype=BF16), torch.ones(4, dtype=FP16)),
            TypeError,
            r"bias dtype float16 not supported; expected bfloat16, float32",
        ),
        (
            (torch.ones(2, 4), torch.ones(4, dtype=BF16)),
            TypeError,
            r"bias dtype bfloat16 not supported; expected float32",
        ),
        (
            (torch.ones(2, 4), torch.ones(5)),
            ValueError,
            r"bias of shape \(5,\) does not fit x of shape \(2, 4\); expected a 1-D bias .*\(4,\)",
        ),
        ((torch.ones(2, 4), torch.ones(1, 4)), ValueError, r"bias of shape \(1, 4\)"),
        ((torch.tensor(1.0), torch.ones(1)), ValueError, r"expected .*None \(x is a scalar\)"),
    ],
)
def test_bad_inputs_raise_saying_what_was_expected(args, error, match) -> None:
    with pytest.raises(error, match=match):
        op(*args)


def test_bias_on_another_device() -> None:
    x = torch.ones(2, 4)
    with pytest.raises(ValueError, match=r"bias is on meta; expected x's device cpu"):
        op(x, torch.ones(4, device="meta"))
