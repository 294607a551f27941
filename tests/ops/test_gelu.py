"""``gelu_tanh_bias``: the meaning, the exact CPU path, the Triton path (interpreter), checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ditops
from ditops import config
from ditops.custom_op import reset_state
from ditops.ops.gelu import gelu_tanh_bias as op
from tests.precision import assert_exact, assert_fast

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


# --- the CPU path: bitwise --------------------------------------------------------------

CPU_CASES = [
    ((4, 7), None),  # odd, small: eager's own calls
    ((3, 5, 33), None),
    ((1, 1), None),
    ((1000, 1001), None),  # odd row width: eager's expression
    ((2, 300, 4096), None),  # blocks (several per call)
    ((1024, 3072), None),
    ((333, 4096), None),  # a ragged last block
    ((1536, 4100), None),  # blocks of 48 rows (fp32): a width that is not a power of 2
    ((2, 300, 4096), FP32),  # fp32 bias with low-precision x
    ((7, 64), FP32),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("shape", "bias_dtype"), CPU_CASES, ids=str)
@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_cpu_path_is_bitwise(shape, bias_dtype, dtype, precision) -> None:
    x, b = inputs(shape, dtype, bias_dtype)
    with config.override(precision=precision), torch.no_grad():
        out = op(x, b)
        assert_exact(op.forward_cpu(x, b), eager(x, b))
    assert_exact(out, eager(x, b))
    assert_exact(op.forward_cpu(x, None), eager(x, None))


def test_blocks_that_split_eagers_vector_steps_would_differ(monkeypatch) -> None:
    """The control: the plan's rule matters. fp32 GELU gives other bits in ATen's scalar
    tail for ~7% of inputs; 127-row blocks of 4100 put tails where eager has none."""
    from ditops.kernels.cpu import gelu as kernel

    x, b = inputs((1536, 4100), FP32)
    assert kernel._plan(x, FP32) == 8  # blocks run (not eager's expression)
    assert_exact(kernel.gelu_tanh_bias(x, b), eager(x, b))
    monkeypatch.setattr(kernel, "_plan", lambda rows, dtype: 127)
    assert not torch.equal(kernel.gelu_tanh_bias(x, b), eager(x, b))


@pytest.mark.parametrize("mode", ["inference", "no_grad", "grad"])
def test_cpu_blocks_under_every_grad_mode(mode: str) -> None:
    """The worker threads take the caller's mode (outputs made in inference mode are
    written in inference mode)."""
    x, b = inputs((2, 300, 4096), BF16)
    ctx = {"inference": torch.inference_mode, "no_grad": torch.no_grad}.get(mode)
    if ctx is None:
        out = op(x, b)
    else:
        with ctx():
            out = op(x, b)
    assert_exact(out, eager(x, b))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_cpu_path_is_bitwise_for_any_thread_count(threads: int) -> None:
    x, b = inputs((1536, 4096), BF16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert_exact(op.forward_cpu(x, b), eager(x, b))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_path_non_contiguous(dtype) -> None:
    base, b = inputs((2, 600, 8192), dtype)
    b = b[:4096]
    for x in (base[:, :, :4096], base[:, ::2, 4096:], base[..., :4096].transpose(0, 1),
              base.transpose(-1, -2)[:, :4096, :600].transpose(-1, -2)):  # fmt: skip
        assert_exact(op.forward_cpu(x, b), eager(x, b))
    strided_bias = torch.randn(8192).to(dtype)[::2]
    assert_exact(
        op.forward_cpu(base[:, :, :4096], strided_bias), eager(base[:, :, :4096], strided_bias)
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_finite_propagate_like_the_meaning(dtype) -> None:
    x, b = inputs((256, 4096), dtype)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -1e30, -0.0])
    x.view(-1)[::997][: 6 * 100] = special.repeat(100)[: x.view(-1)[::997].numel()].to(dtype)
    b[5] = float("inf")
    b[9] = float("nan")
    assert_exact(op.forward_cpu(x, b), eager(x, b))
    with ditops.force_device_kind({"cpu": "cuda"}), torch.no_grad(), config.override(strict=True):
        out = op(x[:4, :512], b[:512])
    ref = eager(x[:4, :512], b[:512])
    assert torch.equal(out.isnan(), ref.isnan())
    inf = ref.isinf()
    assert torch.equal(out.isinf(), inf) and torch.equal(out[inf], ref[inf])


def test_explain_says_cpu_takes_forward_cpu() -> None:
    (cpu,) = ditops.explain("gelu_tanh_bias", device_kinds=["cpu"])
    assert cpu.chosen == "forward_cpu"
    for precision in ("exact", "fast"):
        (d,) = ditops.explain("gelu_tanh_bias", device_kinds=["cpu"], precision=precision)
        assert d.chosen == "forward_cpu"
    x, b = inputs((3, 8), BF16)
    assert op.explain_call(x, b).chosen == "forward_cpu"
    assert "gelu_tanh_bias" in ditops.registered_ops()
    assert ditops.gelu_tanh_bias is op


def test_grad_runs_the_meaning() -> None:
    x, b = inputs((3, 8), FP32)
    x.requires_grad_(True)
    assert op.explain_call(x, b).chosen == "forward_native"
    op(x, b).sum().backward()
    assert x.grad is not None


# --- the Triton path, through the interpreter --------------------------------------------


def triton_tolerance(x: torch.Tensor, b: torch.Tensor | None) -> float:
    """Where eager's fp32 ``1 + tanh`` cancels (very negative inputs) it is itself only
    good to ``|h| * 2**-24`` absolute: allow twice that, beyond 1 ulp."""
    h = x.float() if b is None else (x + b).to(x.dtype).float()
    return float(h.abs().max()) * 2**-23


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("shape", "bias"), [((7,), "same"), ((3, 100), "same"), ((2, 3, 130), "fp32"), ((5, 64), None)],
    ids=str,
)  # fmt: skip
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
        ((torch.ones(3, dtype=torch.int32), None), TypeError,
         r"x dtype int32 not supported; expected"),
        ((torch.ones(2, 4), [0.0] * 4), TypeError, r"bias must be a tensor, got list"),
        ((torch.ones(2, 4, dtype=BF16), torch.ones(4, dtype=FP16)), TypeError,
         r"bias dtype float16 not supported; expected bfloat16, float32"),
        ((torch.ones(2, 4), torch.ones(4, dtype=BF16)), TypeError,
         r"bias dtype bfloat16 not supported; expected float32"),
        ((torch.ones(2, 4), torch.ones(5)), ValueError,
         r"bias of shape \(5,\) does not fit x of shape \(2, 4\); expected a 1-D bias .*\(4,\)"),
        ((torch.ones(2, 4), torch.ones(1, 4)), ValueError, r"bias of shape \(1, 4\)"),
        ((torch.tensor(1.0), torch.ones(1)), ValueError, r"expected .*None \(x is a scalar\)"),
    ],
)  # fmt: skip
def test_bad_inputs_raise_saying_what_was_expected(args, error, match) -> None:
    with pytest.raises(error, match=match):
        op(*args)


def test_bias_on_another_device() -> None:
    x = torch.ones(2, 4)
    with pytest.raises(ValueError, match=r"bias is on meta; expected x's device cpu"):
        op(x, torch.ones(4, device="meta"))
