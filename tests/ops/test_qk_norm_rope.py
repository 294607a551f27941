"""The attention-prologue ops against diffusers' and torch's own code.

Exact mode on CPU must give the bits of the real thing: ``torch.nn.RMSNorm``, diffusers'
``RMSNorm`` and ``apply_rotary_emb`` (both layouts), in fp32 and bf16. Fast mode is held
to the ops' stated tolerance; bad input gets errors naming what was expected; the
dispatcher's choices are checked, the Triton path runs through the interpreter. What
Wan's and FLUX's processors hand to attention: test_qk_norm_rope_prologues.py; the NPU
paths: test_qk_norm_rope_npu.py.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import ditops
from ditops import config
from ditops.custom_op import reset_state
from ditops.layers.rms_norm import RMSNorm
from ditops.ops import qk_norm_rope_args as qkmod
from ditops.ops.qk_norm_rope import qk_norm_rope, rms_norm, rotary_embedding
from tests.precision import assert_exact, assert_fast, assert_fast_pairs

diffusers = pytest.importorskip("diffusers")
from diffusers.models import embeddings as dembed  # noqa: E402
from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm  # noqa: E402

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


EPS = 1e-6


def _exact(fn: Any, *args: Any, **kwargs: Any) -> Any:
    with torch.inference_mode(), config.override(precision="exact"):
        return fn(*args, **kwargs)


def _fast(fn: Any, *args: Any, **kwargs: Any) -> Any:
    with torch.inference_mode(), config.override(precision="fast"):
        return fn(*args, **kwargs)


def _randomise(module: nn.Module) -> nn.Module:
    """Norm weights away from 1 (fresh RMSNorms hold ones: nothing to get wrong)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 + 1)
    return module


@pytest.mark.parametrize("dtype", [FP32, BF16, FP16])
@pytest.mark.parametrize("layout", ["interleaved", "halves"])
@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_apply_rotary_emb(dtype: torch.dtype, layout: str, precision: str) -> None:
    B, L, H, D = 2, 9, 3, 12
    torch.manual_seed(0)
    cos, sin = dembed.get_1d_rotary_pos_embed(
        D, L, use_real=True, repeat_interleave_real=layout == "interleaved"
    )
    x = torch.randn(B, L, H, D).to(dtype)
    unbind = -1 if layout == "interleaved" else -2
    want = dembed.apply_rotary_emb(x, (cos, sin), use_real_unbind_dim=unbind, sequence_dim=1)
    run = _exact if precision == "exact" else _fast
    assert_exact(run(rotary_embedding, x, cos, sin, layout), want)
    # one angle per pair: the same bits
    h = cos[:, 0::2] if layout == "interleaved" else cos[:, : D // 2]
    s = sin[:, 0::2] if layout == "interleaved" else sin[:, : D // 2]
    assert_exact(run(rotary_embedding, x, h, s, layout), want)


def test_apply_rotary_emb_tables_without_equal_pairs() -> None:
    """Tables whose pair members differ are read element by element, as apply_rotary_emb
    reads them."""
    x = torch.randn(1, 7, 2, 8).to(BF16)
    cos, sin = torch.randn(7, 8), torch.randn(7, 8)
    for unbind, layout in ((-1, "interleaved"), (-2, "halves")):
        want = dembed.apply_rotary_emb(x, (cos, sin), use_real_unbind_dim=unbind, sequence_dim=1)
        assert_exact(_exact(rotary_embedding, x, cos, sin, layout), want)


@pytest.mark.parametrize("x_dtype", [FP32, BF16, FP16])
@pytest.mark.parametrize("w_dtype", [None, FP32, BF16])
@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_diffusers_rms_norm(x_dtype: torch.dtype, w_dtype: Any, precision: str) -> None:
    torch.manual_seed(0)
    ref = DiffusersRMSNorm(40, eps=EPS, elementwise_affine=w_dtype is not None)
    if w_dtype is not None:
        _randomise(nn.ModuleDict({"norm": ref}))
        ref = ref.to(w_dtype)
    x = (torch.randn(3, 17, 40) * 3).to(x_dtype)
    with torch.inference_mode():
        want = ref(x)
    mod = RMSNorm.from_module(ref)
    assert mod.convention == "diffusers" and mod.weight is ref.weight
    run = _exact if precision == "exact" else _fast
    got = run(mod, x)
    if precision == "exact" or got.dtype == FP32:
        assert_exact(got, want)
    else:
        assert_fast(got, want, max_ulp=2)


@pytest.mark.parametrize("x_dtype", [FP32, BF16, FP16])
@pytest.mark.parametrize("w_dtype", [None, FP32, BF16])
@pytest.mark.parametrize("eps", [EPS, None])
def test_torch_rms_norm(x_dtype: torch.dtype, w_dtype: Any, eps: Any) -> None:
    torch.manual_seed(0)
    ref = nn.RMSNorm(40, eps=eps, elementwise_affine=w_dtype is not None)
    if w_dtype is not None:
        _randomise(nn.ModuleDict({"norm": ref}))
        ref = ref.to(w_dtype)
    x = (torch.randn(3, 17, 40) * 3).to(x_dtype)
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's once-only note on mismatched dtypes
        want = ref(x)
    mod = RMSNorm.from_module(ref)
    assert_exact(_exact(mod, x), want)
    got = _fast(mod, x)
    if got.dtype == FP32:
        assert_exact(got, want)
    else:
        assert_fast(got, want)


def test_torch_rms_norm_arithmetic_is_known() -> None:
    """The probe recognises this torch's F.rms_norm (else every fast path would be off)."""
    assert qkmod.torch_rms_norm_is_known()


@pytest.mark.parametrize(
    ("convention", "across"), [("torch", True), ("torch", False), ("diffusers", False)]
)
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_fast_contract_rates(convention: str, across: bool, dtype: torch.dtype) -> None:
    B, L, H, D = 1, 96, 12, 128
    g = torch.Generator().manual_seed(0)
    q, k = ((torch.randn(B, L, H, D, generator=g) * 2).to(dtype) for _ in range(2))
    n = H * D if across else D
    wq, wk = ((torch.randn(n, generator=g) * 0.5 + 1).to(dtype) for _ in range(2))
    ang = torch.rand(L, D // 2, generator=g) * 6.3
    args = (q, k, wq, wk, ang.cos(), ang.sin(), EPS)
    kw = {"across_heads": across, "convention": convention}
    want = qk_norm_rope.op.forward_native(
        *args, across_heads=across, layout="interleaved", convention=convention
    )
    got = _fast(qk_norm_rope, *args, **kw)
    # diffusers with a bf16/fp16 weight rounds twice more in eager: 2 ulps, rarely
    for g_, w_ in zip(got, want):
        assert_fast_pairs(g_, w_, "interleaved", max_ulp=1 if convention == "torch" else 2)
        assert (g_ != w_).float().mean() < 0.5  # rounded once: many differ by 1, not most


def _non_finite_qk(B: int, L: int, H: int, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 q and k with a NaN and infinities in places the tests know."""
    q, k = torch.randn(B, L, H, D).to(BF16), torch.randn(B, L, H, D).to(BF16)
    q[0, 1, 2, 3] = float("nan")
    q[0, 4, 0, 0] = float("inf")
    k[0, 2, 1, 5] = -float("inf")
    return q, k


@pytest.mark.parametrize("precision", ["exact", "fast"])
@pytest.mark.parametrize("across", [False, True])
def test_nan_and_inf_propagate(precision: str, across: bool) -> None:
    B, L, H, D = 1, 6, 3, 8
    q, k = _non_finite_qk(B, L, H, D)
    n = H * D if across else D
    cos, sin = torch.randn(L, D // 2), torch.randn(L, D // 2)
    cos[5, 1] = float("nan")
    w = torch.rand(n).to(BF16)
    args = (q, k, w, w, cos, sin, EPS)
    want = qk_norm_rope.op.forward_native(
        *args, across_heads=across, layout="interleaved", convention="torch"
    )
    run = _exact if precision == "exact" else _fast
    got = run(qk_norm_rope, *args, across_heads=across)
    for g_, w_ in zip(got, want):
        assert w_.isnan().any()
        if precision == "exact":
            assert_exact(g_, w_)
        else:
            assert_fast_pairs(g_, w_, "interleaved", slack=5)


def _qk(D: int = 8, L: int = 5, H: int = 2) -> tuple[torch.Tensor, ...]:
    q = torch.randn(2, L, H, D)
    return (
        q,
        q.clone(),
        torch.ones(D),
        torch.ones(D),
        torch.randn(L, D // 2),
        torch.randn(L, D // 2),
    )


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (
            lambda a: {**a, "q": a["q"][..., :7], "k": a["k"][..., :7]},
            ValueError,
            "odd head dim D = 7",
        ),
        (lambda a: {**a, "q": a["q"][0]}, ValueError, r"\[B, L, H, D\]"),
        (lambda a: {**a, "k": a["k"][:, :4]}, ValueError, "expected q's shape"),
        (lambda a: {**a, "k": a["k"].double()}, TypeError, "expected q's dtype"),
        (lambda a: {**a, "q": a["q"].int(), "k": a["k"].int()}, TypeError, "expected float32"),
        (lambda a: {**a, "cos": a["cos"][:4], "sin": a["sin"][:4]}, ValueError, "L = 5"),
        (
            lambda a: {**a, "cos": torch.randn(5, 3), "sin": torch.randn(5, 3)},
            ValueError,
            r"Dt in \{8, 4\}",
        ),
        (lambda a: {**a, "sin": a["sin"][:, :3]}, ValueError, "expected the same"),
        (
            lambda a: {**a, "cos": a["cos"].double(), "sin": a["sin"].double()},
            TypeError,
            "expected float32",
        ),
        (
            lambda a: {**a, "cos": torch.randn(3, 5, 1, 4), "sin": torch.randn(3, 5, 1, 4)},
            ValueError,
            r"Bt in \{1, 2\}",
        ),
        (
            lambda a: {**a, "cos": torch.randn(1, 5, 2, 4), "sin": torch.randn(1, 5, 2, 4)},
            ValueError,
            r"\[Bt, L, 1, Dt\]",
        ),
        (lambda a: {**a, "q_weight": torch.ones(16)}, ValueError, r"\[D \(per head\)\] = \[8\]"),
        (
            lambda a: {**a, "q_weight": torch.ones(8), "across_heads": True},
            ValueError,
            r"H \* D \(across heads\)\] = \[16\]",
        ),
        (lambda a: {**a, "k_weight": None}, TypeError, "both be None or both tensors"),
        (lambda a: {**a, "k_weight": a["k_weight"].bfloat16()}, TypeError, "of one dtype"),
        (
            lambda a: {**a, "q_weight": torch.ones(8, dtype=torch.int64)},
            TypeError,
            "q_weight has dtype int64",
        ),
        (lambda a: {**a, "layout": "rotate_half"}, ValueError, "'interleaved', 'halves'"),
        (lambda a: {**a, "convention": "flux"}, ValueError, "'torch', 'diffusers'"),
        (lambda a: {**a, "convention": "diffusers", "eps": None}, TypeError, "needs an eps"),
        (lambda a: {**a, "eps": "small"}, TypeError, "eps must be a real number"),
        (lambda a: {**a, "across_heads": 1}, TypeError, "across_heads must be a bool"),
    ],
)
def test_bad_input_is_refused(change: Any, error: type, match: str) -> None:
    q, k, wq, wk, cos, sin = _qk()
    a = {
        "q": q,
        "k": k,
        "q_weight": wq,
        "k_weight": wk,
        "cos": cos,
        "sin": sin,
        "eps": EPS,
        "across_heads": False,
        "layout": "interleaved",
        "convention": "torch",
    }
    a = change(a)
    with pytest.raises(error, match=match):
        qk_norm_rope(**a)


def test_bad_input_of_the_single_ops() -> None:
    x = torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match=r"must have shape \[N, the last dim of x\] = \[4\]"):
        rms_norm(x, torch.ones(5))
    with pytest.raises(ValueError, match="at least one dim"):
        rms_norm(torch.tensor(1.0))
    with pytest.raises(ValueError, match="odd head dim"):
        rotary_embedding(torch.randn(1, 3, 2, 5), torch.randn(3, 5), torch.randn(3, 5))
    with pytest.raises(TypeError, match="RMSNorm or a diffusers RMSNorm"):
        RMSNorm.from_module(nn.LayerNorm(4))
    with pytest.raises(ValueError, match="bias"):
        RMSNorm.from_module(DiffusersRMSNorm(4, eps=EPS, bias=True))


def test_dispatch_choices() -> None:
    q, k, wq, wk, cos, sin = _qk()
    with torch.inference_mode():
        assert qk_norm_rope.op.explain_call(q, k, wq, wk, cos, sin, EPS).chosen == "forward_cpu"
        assert (
            qk_norm_rope.op.explain_call(
                q.double(), k.double(), wq, wk, cos.double(), sin.double(), EPS
            ).chosen
            == "forward_native"
        )
    wg = wq.clone().requires_grad_()
    decision = qk_norm_rope.op.explain_call(q, k, wg, wk, cos, sin, EPS)
    assert decision.chosen == "forward_native"
    assert "grad" in decision.candidates[0].reasons[0]
    out = qk_norm_rope(q, k, wg, wk, cos, sin, EPS)
    out[0].sum().backward()  # the meaning has a backward
    assert wg.grad is not None


def test_unknown_torch_arithmetic_runs_the_meaning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(qkmod, "torch_rms_norm_is_known", lambda: False)
    q, k, wq, wk, cos, sin = _qk()
    with torch.inference_mode():
        d = qk_norm_rope.op.explain_call(q, k, wq, wk, cos, sin, EPS)
        assert d.chosen == "forward_native"
        assert "rounds differently" in d.candidates[0].reasons[0]
        assert rms_norm.op.explain_call(q, wq).chosen == "forward_native"
        # the diffusers convention does not depend on torch's RMSNorm
        assert rms_norm.op.explain_call(q, wq, EPS, "diffusers").chosen == "forward_cpu"


def test_fp64_and_other_devices_explained() -> None:
    for name in ("rms_norm", "rotary_embedding", "qk_norm_rope"):
        decisions = ditops.explain(name, ["cpu", "mps", "npu"])
        assert [d.chosen for d in decisions] == ["forward_cpu", "forward_native", "forward_native"]


def test_module_precision_is_per_module() -> None:
    x = (torch.randn(64, 96) * 3).bfloat16()
    exact = RMSNorm(96, eps=EPS, precision="exact")
    with torch.no_grad():
        exact.weight.copy_(torch.rand(96) + 0.5)
    want = exact.forward_native(x)
    with torch.inference_mode(), config.override(precision="fast"):
        assert_exact(exact(x), want)
    assert "convention='torch'" in repr(exact)


def test_torch_compile_sees_one_op() -> None:
    torch._dynamo.reset()
    q, k, wq, wk, cos, sin = _qk(D=16, L=12)
    q, k = q.bfloat16(), k.bfloat16()

    def prologue(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        a, b = qk_norm_rope(q, k, wq, wk, cos, sin, EPS)
        return a + b

    with torch.no_grad(), config.override(precision="exact"):
        eager = prologue(q, k)
        compiled = torch.compile(prologue, fullgraph=True)(q, k)
    assert_exact(compiled, eager)


def test_custom_ops_have_fakes() -> None:
    q, k, wq, wk, cos, sin = _qk()
    checks = ("test_schema", "test_faketensor")
    c3, s3 = cos.unsqueeze(0), sin.unsqueeze(0)
    ops = torch.ops.ditops
    torch.library.opcheck(
        ops.cpu_qk_norm_rope.default,
        (q, k, wq, wk, c3, s3, EPS, False, "interleaved", "torch", True),
        test_utils=checks,
    )
    torch.library.opcheck(
        ops.cpu_rotary_embedding.default, (q, c3, s3, "halves"), test_utils=checks
    )
    torch.library.opcheck(
        ops.cpu_rms_norm.default, (q.bfloat16(), wq, EPS, "diffusers", False), test_utils=checks
    )


@pytest.fixture
def on_cuda() -> Iterator[None]:
    reset_state()
    with (
        ditops.force_device_kind({"cpu": "cuda"}),
        torch.inference_mode(),
        config.override(strict=True),
    ):
        yield
    reset_state()


@pytest.mark.parametrize("across", [False, True])
@pytest.mark.parametrize("convention", ["torch", "diffusers"])
def test_triton_path_through_the_dispatcher(on_cuda: None, across: bool, convention: str) -> None:
    q, k, wq, wk, cos, sin = _qk()
    q, k = q.bfloat16(), k.bfloat16()
    n = q.shape[2] * q.shape[3] if across else q.shape[3]
    wq, wk = torch.rand(n).bfloat16() + 0.5, torch.rand(n).bfloat16() + 0.5
    args = (q, k, wq, wk, cos, sin, EPS)
    assert qk_norm_rope.op.explain_call(
        *args, across_heads=across, convention=convention
    ).chosen == ("forward_cuda")
    got = qk_norm_rope(*args, across_heads=across, convention=convention)
    want = qk_norm_rope.op.forward_native(
        *args, across_heads=across, layout="interleaved", convention=convention
    )
    for g_, w_ in zip(got, want):
        assert_fast_pairs(g_, w_, "interleaved", max_ulp=2, slack=5)


def test_triton_declines_low_precision_rotation(on_cuda: None) -> None:
    q, k, wq, wk, cos, sin = _qk()
    q, k = q.bfloat16(), k.bfloat16()
    d = qk_norm_rope.op.explain_call(q, k, wq, wk, cos.bfloat16(), sin.bfloat16(), EPS)
    assert d.chosen == "forward_native"
    assert "computed in bfloat16" in " ".join(d.candidates[0].reasons)
    # the same tables in fp32 take the kernel
    assert qk_norm_rope.op.explain_call(q, k, wq, wk, cos, sin, EPS).chosen == "forward_cuda"
