"""The attention-prologue ops' NPU paths against the meaning, on the torch_npu doubles
(tests/doubles/npu_modules.py): eligible calls, the calls that run the meaning and why,
and a package that is missing or raises.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from ditops import config
from ditops.custom_op import BackendUnavailableError, reset_state
from ditops.ops.qk_norm_rope import qk_norm_rope, rms_norm, rotary_embedding
from tests.doubles.npu_modules import fake_torch_npu_prologue
from tests.precision import assert_exact, assert_fast, assert_fast_pairs, pair_magnitude

diffusers = pytest.importorskip("diffusers")
from tests.ops.test_qk_norm_rope import BF16, EPS, FP16, FP32, _non_finite_qk, _qk  # noqa: E402


@pytest.fixture
def npu_fast(on_npu: None) -> Iterator[None]:
    """CPU tensors take the npu paths, fast precision, no grad; strict, so a call the
    double refuses fails the test instead of falling back."""
    with torch.inference_mode(), config.override(precision="fast", strict=True):
        yield


def _npu_tables(L: int, D: int, width: int, Bt: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rope tables (rotations: cos^2 + sin^2 = 1), [L, width] or [Bt, L, 1, width]."""
    angles = torch.rand(max(Bt, 1), L, width) * 6.3
    cos, sin = angles.cos(), angles.sin()
    if Bt:
        return cos.unsqueeze(2), sin.unsqueeze(2)
    return cos[0], sin[0]


@pytest.mark.parametrize("convention", ["torch", "diffusers"])
@pytest.mark.parametrize("x_dtype", [BF16, FP16, FP32])
@pytest.mark.parametrize("w_dtype", [None, "x", FP32, BF16])
def test_npu_rms_norm_against_the_meaning(
    npu_fast: None, convention: str, x_dtype: torch.dtype, w_dtype: Any
) -> None:
    wd = x_dtype if w_dtype == "x" else w_dtype
    x = (torch.randn(3, 7, 200) * 3).to(x_dtype)
    w = None if wd is None else (torch.rand(200) + 0.5).to(wd)
    with fake_torch_npu_prologue() as calls:
        assert rms_norm.op.explain_call(x, w, EPS, convention).chosen == "forward_npu"
        got = rms_norm(x, w, EPS, convention)
    assert calls == ["npu_rms_norm"]
    want = rms_norm.op.forward_native(x, w, EPS, convention)
    if want.dtype == FP32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:
        twice = convention == "diffusers" and wd in (BF16, FP16)
        assert_fast(got, want, max_ulp=2 if twice else 1)


@pytest.mark.parametrize("layout", ["interleaved", "halves"])
@pytest.mark.parametrize("x_dtype", [BF16, FP16, FP32])
@pytest.mark.parametrize("per_pair", [True, False])
def test_npu_rotary_embedding_against_the_meaning(
    npu_fast: None, layout: str, x_dtype: torch.dtype, per_pair: bool
) -> None:
    B, L, H, D = 2, 9, 3, 12
    x = (torch.randn(B, L, H, D) * 2).to(x_dtype)
    cos, sin = _npu_tables(L, D, D // 2 if per_pair else D)
    with fake_torch_npu_prologue() as calls:
        assert rotary_embedding.op.explain_call(x, cos, sin, layout).chosen == "forward_npu"
        got = rotary_embedding(x, cos, sin, layout)
    assert calls == ["npu_rotary_mul"]
    want = rotary_embedding.op.forward_native(x, cos, sin, layout)
    if x_dtype == FP32:
        mag = pair_magnitude(want, layout)
        assert bool(((got - want).abs() <= 1e-5 * mag).all())
    else:
        assert_fast_pairs(got, want, layout, max_ulp=1)


def test_npu_rotary_halves_with_per_batch_tables(npu_fast: None) -> None:
    x = torch.randn(2, 5, 3, 8).bfloat16()
    cos, sin = _npu_tables(5, 8, 4, Bt=2)
    with fake_torch_npu_prologue() as calls:
        got = rotary_embedding(x, cos, sin, "halves")
    assert calls == ["npu_rotary_mul"]
    assert_fast_pairs(got, rotary_embedding.op.forward_native(x, cos, sin, "halves"), "halves", 1)


@pytest.mark.parametrize("across", [False, True])
@pytest.mark.parametrize("convention", ["torch", "diffusers"])
@pytest.mark.parametrize("layout", ["interleaved", "halves"])
def test_npu_qk_norm_rope_against_the_meaning(
    npu_fast: None, across: bool, convention: str, layout: str
) -> None:
    B, L, H, D = 1, 11, 3, 16
    q, k = (torch.randn(B, L, H, D) * 3).bfloat16(), torch.randn(B, L, H, D).bfloat16()
    n = H * D if across else D
    wq, wk = (torch.rand(n) + 0.5).bfloat16(), (torch.rand(n) + 0.5).bfloat16()
    cos, sin = _npu_tables(L, D, D // 2)
    args = (q, k, wq, wk, cos, sin, EPS)
    kw = {"across_heads": across, "layout": layout, "convention": convention}
    with fake_torch_npu_prologue() as calls:
        assert qk_norm_rope.op.explain_call(*args, **kw).chosen == "forward_npu"
        got = qk_norm_rope(*args, **kw)
    assert calls == ["npu_rms_norm", "npu_rotary_mul"] * 2
    want = qk_norm_rope.op.forward_native(
        *args, across_heads=across, layout=layout, convention=convention
    )
    for g_, w_ in zip(got, want):
        assert_fast_pairs(g_, w_, layout, max_ulp=2, slack=5)


def _ineligible() -> list[tuple[str, Any, str]]:
    """(op, a call's arguments builder, the reason's words)."""
    bf = BF16

    def rope(B: int = 1, L: int = 4, H: int = 2, D: int = 8, **kw: Any) -> tuple[Any, ...]:
        x = torch.randn(B, L, H, D).to(kw.get("dtype", bf))
        cos, sin = _npu_tables(L, D, D // 2, Bt=kw.get("Bt", 0))
        if kw.get("out_of_range"):
            cos = cos.clone()
            cos.view(-1)[0] = 1.5
        if kw.get("bf16_tables"):
            cos, sin = cos.to(bf), sin.to(bf)
        return (x, cos, sin, kw.get("layout", "interleaved"))

    return [
        ("rotary_embedding", lambda: rope(bf16_tables=True), "computed in bfloat16"),
        ("rotary_embedding", lambda: rope(D=896, L=1, H=1), "head dim 896"),
        ("rotary_embedding", lambda: rope(H=1000, L=1, D=2), "batch x heads = 1000"),
        ("rotary_embedding", lambda: rope(H=1000, L=1, D=2, layout="halves"), "heads 1000"),
        ("rotary_embedding", lambda: rope(B=2, Bt=2), "per-batch tables"),
        ("rotary_embedding", lambda: rope(out_of_range=True), "outside [-1, 1]"),
        ("rotary_embedding", lambda: rope(L=0), "empty input"),
        ("rms_norm", lambda: (torch.randn(0, 8).to(bf),), "empty input"),
    ]


@pytest.mark.parametrize("case", range(len(_ineligible())))
def test_npu_ineligible_calls_run_the_meaning_with_a_reason(
    npu_fast: None, case: int, ditops_warnings: Any
) -> None:
    name, build, words = _ineligible()[case]
    op = {"rotary_embedding": rotary_embedding, "rms_norm": rms_norm}[name].op
    args = build()
    with fake_torch_npu_prologue() as calls:
        decision = op.explain_call(*args)
        got = op(*args)
    assert decision.chosen == "forward_native"
    assert words in " ".join(decision.candidates[0].reasons)
    assert calls == [] and ditops_warnings() == []
    assert_exact(got, op.forward_native(*args))


def test_npu_qk_norm_rope_declines_low_precision_rotation(npu_fast: None) -> None:
    q, k, wq, wk, cos, sin = _qk()
    q, k = q.bfloat16(), k.bfloat16()
    args = (q, k, wq, wk, cos.bfloat16().clamp(-1, 1), sin.bfloat16().clamp(-1, 1), EPS)
    with fake_torch_npu_prologue() as calls:
        d = qk_norm_rope.op.explain_call(*args)
        got = qk_norm_rope(*args)
    assert d.chosen == "forward_native" and calls == []
    assert "computed in bfloat16" in " ".join(d.candidates[0].reasons)
    for g_, w_ in zip(
        got,
        qk_norm_rope.op.forward_native(
            *args, across_heads=False, layout="interleaved", convention="torch"
        ),
    ):
        assert_exact(g_, w_)


def test_npu_exact_precision_runs_the_meaning(on_npu: None) -> None:
    x = torch.randn(4, 16).bfloat16()
    with fake_torch_npu_prologue() as calls, torch.inference_mode():
        with config.override(precision="exact"):
            d = rms_norm.op.explain_call(x)
            got = rms_norm(x)
    assert d.chosen == "forward_native" and calls == []
    assert "does not promise precision='exact'" in d.candidates[0].reasons[0]
    assert_exact(got, rms_norm.op.forward_native(x))


def test_npu_without_torch_npu_or_its_functions(npu_fast: None) -> None:
    q, k, wq, wk, cos, sin = _qk()
    args = (q, k, wq, wk, cos.clamp(-1, 1), sin.clamp(-1, 1), EPS)
    with pytest.raises(BackendUnavailableError, match="torch_npu is not installed"):
        qk_norm_rope(*args)  # strict
    with config.override(strict=False):
        _without_torch_npu_or_its_functions(args)


def _without_torch_npu_or_its_functions(args: tuple[Any, ...]) -> None:
    q = args[0]
    missing = qk_norm_rope.op.explain_call(*args)  # on_npu: torch_npu is not installed
    assert missing.chosen == "forward_native"
    assert missing.candidates[0].reasons[0].startswith("torch_npu is not installed")
    with fake_torch_npu_prologue({"npu_rotary_mul": None}) as calls:
        assert rms_norm.op.explain_call(q).chosen == "forward_npu"
        for op, op_args in ((rotary_embedding.op, args[:1] + args[4:6]), (qk_norm_rope.op, args)):
            d = op.explain_call(*op_args)
            assert d.chosen == "forward_native"
            assert "has no torch_npu.npu_rotary_mul" in " ".join(d.candidates[0].reasons)
        got = qk_norm_rope(*args)
    assert calls == []
    for g_, w_ in zip(
        got,
        qk_norm_rope.op.forward_native(
            *args, across_heads=False, layout="interleaved", convention="torch"
        ),
    ):
        assert_exact(g_, w_)


def test_npu_function_that_raises_is_given_up_once(npu_fast: None, ditops_warnings: Any) -> None:
    def broken(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError("EZ9999: aclnnRotaryPositionEmbedding failed")

    x = torch.randn(1, 4, 2, 8).bfloat16()
    cos, sin = _npu_tables(4, 8, 4)
    with (
        fake_torch_npu_prologue({"npu_rotary_mul": broken}),
        pytest.raises(BackendUnavailableError, match="EZ9999"),
    ):
        rotary_embedding(x, cos, sin)  # strict
    reset_state()
    lenient = config.override(strict=False)
    with lenient, fake_torch_npu_prologue({"npu_rotary_mul": broken}) as calls:
        got = rotary_embedding(x, cos, sin)
        again = rotary_embedding(x, cos, sin)
        d = rotary_embedding.op.explain_call(x, cos, sin)
    want = rotary_embedding.op.forward_native(x, cos, sin)
    assert_exact(got, want)
    assert_exact(again, want)
    assert calls == ["npu_rotary_mul"]  # not called again
    assert d.chosen == "forward_native" and "EZ9999" in d.candidates[0].reasons[0]
    (warning,) = ditops_warnings()
    assert "falls back to forward_native" in warning and "EZ9999" in warning


@pytest.mark.parametrize("across", [False, True])
def test_npu_nan_and_inf_propagate(npu_fast: None, across: bool) -> None:
    B, L, H, D = 1, 6, 3, 8
    q, k = _non_finite_qk(B, L, H, D)
    w = torch.rand(H * D if across else D).to(BF16)
    cos, sin = _npu_tables(L, D, D // 2)
    args = (q, k, w, w, cos, sin, EPS)
    with fake_torch_npu_prologue() as calls:
        got = qk_norm_rope(*args, across_heads=across)
    assert calls  # the NPU path ran
    for g_, w_ in zip(
        got,
        qk_norm_rope.op.forward_native(
            *args, across_heads=across, layout="interleaved", convention="torch"
        ),
    ):
        assert w_.isnan().any()
        assert_fast_pairs(g_, w_, "interleaved", slack=5)
    cos[5, 1] = float("nan")  # a NaN table entry is outside [-1, 1]: the meaning runs
    with fake_torch_npu_prologue() as calls:
        d = qk_norm_rope.op.explain_call(*args, across_heads=across)
    assert "outside [-1, 1]" in d.candidates[0].reasons[0] and calls == []
