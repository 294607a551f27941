"""The attention-prologue ops against diffusers' and torch's own code.

Exact mode on CPU must give the bits of the real thing: ``torch.nn.RMSNorm``, diffusers'
``RMSNorm`` and ``apply_rotary_emb`` (both layouts), and what Wan's and FLUX's attention
processors hand to attention (captured by replacing their ``dispatch_attention_fn``), in
fp32 and bf16, with the models' own rope tables. Fast mode is held to the ops' stated
tolerance; bad input gets errors naming what was expected; the dispatcher's choices are
checked, the Triton path runs through the interpreter.
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
from ditops.custom_op import BackendUnavailableError, reset_state
from ditops.layers.rms_norm import RMSNorm
from ditops.ops import qk_norm_rope_args as qkmod
from ditops.ops.qk_norm_rope import qk_norm_rope, rms_norm, rotary_embedding
from tests.doubles.npu_modules import fake_torch_npu_prologue
from tests.precision import assert_exact, assert_fast, assert_fast_pairs, pair_magnitude

diffusers = pytest.importorskip("diffusers")
from diffusers.models import embeddings as dembed  # noqa: E402
from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm  # noqa: E402
from diffusers.models.transformers import transformer_flux as dflux  # noqa: E402
from diffusers.models.transformers import transformer_wan as dwan  # noqa: E402

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
EPS = 1e-6


def _exact(fn: Any, *args: Any, **kwargs: Any) -> Any:
    with torch.inference_mode(), config.override(precision="exact"):
        return fn(*args, **kwargs)


def _fast(fn: Any, *args: Any, **kwargs: Any) -> Any:
    with torch.inference_mode(), config.override(precision="fast"):
        return fn(*args, **kwargs)


class _Capture:
    """Stands in for a diffusers module's ``dispatch_attention_fn``: keeps q and k."""

    def __init__(self) -> None:
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **_: Any):
        self.calls.append((query, key))
        return torch.zeros_like(query)


@pytest.fixture
def capture(monkeypatch: pytest.MonkeyPatch) -> _Capture:
    cap = _Capture()
    monkeypatch.setattr(dwan, "dispatch_attention_fn", cap)
    monkeypatch.setattr(dflux, "dispatch_attention_fn", cap)
    return cap


def _randomise(module: nn.Module) -> nn.Module:
    """Norm weights away from 1 (fresh RMSNorms hold ones: nothing to get wrong)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 + 1)
    return module


# --- Wan ---------------------------------------------------------------------------------

#: (attention dtype, rope dtype): fp32; bf16 as from_pretrained keeps it (rope in fp32,
#: _keep_in_fp32_modules); bf16 after model.to(bf16) (rope buffers cast too).
WAN_SETUPS = {"fp32": (FP32, FP32), "bf16": (BF16, FP32), "bf16-cast": (BF16, BF16)}


@pytest.mark.parametrize("setup", list(WAN_SETUPS))
@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_wan_processor_prologue(capture: _Capture, setup: str, precision: str) -> None:
    dtype, rope_dtype = WAN_SETUPS[setup]
    heads, head_dim, frames, h, w = 3, 16, 2, 4, 6
    torch.manual_seed(0)
    attn = dwan.WanAttention(
        heads * head_dim, heads, head_dim, eps=EPS, processor=dwan.WanAttnProcessor()
    )
    attn = _randomise(attn).to(dtype)
    rope = dwan.WanRotaryPosEmbed(head_dim, (1, 2, 2), max_seq_len=64).to(rope_dtype)
    rotary = rope(torch.zeros(1, 4, frames, 2 * h, 2 * w))
    x = torch.randn(2, frames * h * w, heads * head_dim).to(dtype)
    with torch.inference_mode():
        attn(x, None, None, rotary)
    ((want_q, want_k),) = capture.calls
    q = attn.to_q(x).unflatten(2, (heads, -1))
    k = attn.to_k(x).unflatten(2, (heads, -1))
    cos, sin = rotary[0][..., 0::2], rotary[1][..., 1::2]  # the entries Wan's processor reads
    run = _exact if precision == "exact" else _fast
    got_q, got_k = run(
        qk_norm_rope, q, k, attn.norm_q.weight, attn.norm_k.weight, cos, sin, attn.norm_q.eps,
        across_heads=True,
    )  # fmt: skip
    for got, want in ((got_q, want_q), (got_k, want_k)):
        if precision == "exact" or setup == "bf16-cast" or dtype == FP32:
            # fast with bf16 tables, and fp32 outputs, run eager's steps: exact too
            assert_exact(got, want)
        else:
            assert_fast_pairs(got, want, "interleaved", slack=5)


# --- FLUX --------------------------------------------------------------------------------


def _flux_rotary(text: int, image: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.cat([torch.zeros(text, 3), torch.randint(0, 16, (image, 3)).float()])
    return dflux.FluxPosEmbed(theta=10000, axes_dim=[4, 6, 6])(ids)


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_flux_single_stream_prologue_exact(capture: _Capture, dtype: torch.dtype) -> None:
    heads, head_dim, L = 2, 16, 11
    torch.manual_seed(0)
    attn = dflux.FluxAttention(heads * head_dim, heads, head_dim, eps=EPS, pre_only=True)
    attn = _randomise(attn).to(dtype)
    cos, sin = _flux_rotary(4, L - 4)
    x = torch.randn(2, L, heads * head_dim).to(dtype)
    with torch.inference_mode():
        attn(x, image_rotary_emb=(cos, sin))
    ((want_q, want_k),) = capture.calls
    q = attn.to_q(x).unflatten(-1, (-1, head_dim))
    k = attn.to_k(x).unflatten(-1, (-1, head_dim))
    got = _exact(qk_norm_rope, q, k, attn.norm_q.weight, attn.norm_k.weight, cos, sin, EPS)
    assert_exact(got[0], want_q)
    assert_exact(got[1], want_k)
    if dtype == BF16:
        fast = _fast(qk_norm_rope, q, k, attn.norm_q.weight, attn.norm_k.weight, cos, sin, EPS)
        assert_fast_pairs(fast[0], want_q, "interleaved", slack=5)


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_flux_double_stream_prologue_exact(capture: _Capture, dtype: torch.dtype) -> None:
    """Text and image tokens are normalised with their own weights, then concatenated and
    rotated together: one call per part, each on its slice of the tables."""
    heads, head_dim, text, image = 2, 16, 5, 9
    torch.manual_seed(0)
    attn = dflux.FluxAttention(
        heads * head_dim, heads, head_dim, eps=EPS, added_kv_proj_dim=24, context_pre_only=False
    )
    attn = _randomise(attn).to(dtype)
    cos, sin = _flux_rotary(text, image)
    x, ctx = torch.randn(1, image, heads * head_dim).to(dtype), torch.randn(1, text, 24).to(dtype)
    with torch.inference_mode():
        attn(x, ctx, image_rotary_emb=(cos, sin))
    ((want_q, want_k),) = capture.calls

    def split(t: torch.Tensor) -> torch.Tensor:
        return t.unflatten(-1, (-1, head_dim))

    txt = _exact(
        qk_norm_rope, split(attn.add_q_proj(ctx)), split(attn.add_k_proj(ctx)),
        attn.norm_added_q.weight, attn.norm_added_k.weight, cos[:text], sin[:text], EPS,
    )  # fmt: skip
    img = _exact(
        qk_norm_rope, split(attn.to_q(x)), split(attn.to_k(x)),
        attn.norm_q.weight, attn.norm_k.weight, cos[text:], sin[text:], EPS,
    )  # fmt: skip
    assert_exact(torch.cat([txt[0], img[0]], 1), want_q)
    assert_exact(torch.cat([txt[1], img[1]], 1), want_k)


# --- diffusers' apply_rotary_emb, both layouts ---------------------------------------------


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


# --- the two RMSNorms ---------------------------------------------------------------------


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


# --- the fast contract at a realistic size ----------------------------------------------------


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


# --- NaN and inf ---------------------------------------------------------------------------


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


# --- bad input -------------------------------------------------------------------------------


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
    ],  # fmt: skip
)
def test_bad_input_is_refused(change: Any, error: type, match: str) -> None:
    q, k, wq, wk, cos, sin = _qk()
    a = {"q": q, "k": k, "q_weight": wq, "k_weight": wk, "cos": cos, "sin": sin, "eps": EPS,
         "across_heads": False, "layout": "interleaved", "convention": "torch"}  # fmt: skip
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


# --- dispatch -----------------------------------------------------------------------------


def test_dispatch_choices() -> None:
    q, k, wq, wk, cos, sin = _qk()
    with torch.inference_mode():
        assert qk_norm_rope.op.explain_call(q, k, wq, wk, cos, sin, EPS).chosen == "forward_cpu"
        assert qk_norm_rope.op.explain_call(q.double(), k.double(), wq, wk, cos.double(),
                                         sin.double(), EPS).chosen == "forward_native"  # fmt: skip
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


# --- torch.compile ----------------------------------------------------------------------


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


# --- the Triton path, through the interpreter ------------------------------------------


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


# --- the NPU paths, through the torch_npu double ---------------------------------------------


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
