"""The CPU modulation kernels and the shape normalisation they rely on.

Exact mode must give the bits of the eager expressions (written out here with the
modulation in its original shape, as Wan writes them); fast mode stays within the
modulation ops' tolerance. Blocks are made a few rows long (``small_blocks``) so every
test walks many blocks, per-frame segments and ragged ends.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from ditops.kernels.cpu import blocks
from ditops.kernels.cpu import modulation as K
from ditops.ops import modulation_args as shapes
from tests.precision import assert_exact, assert_fast

B, L, C, FRAMES = 2, 12, 40, 3
EPS = 1e-6
#: fast-mode cancellation allowance (the layer's documented tolerance)
ATOL = 1e-5


@pytest.fixture(params=["whole", "pieces"])
def small_blocks(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both plans of the blocked kernels. ``whole``: 5 rows per block, one LayerNorm call
    per block (blocks straddle frames of 4 tokens and end raggedly). ``pieces``: what a
    fresh-pages allocator gets, LayerNorm on pieces of 2 fp32 rows (4 low-precision ones)."""
    monkeypatch.setattr(K, "_BLOCK_BYTES", 4 * C * 5)
    pieces = request.param == "pieces"
    monkeypatch.setattr(blocks, "PIECE_BYTES", 4 * C * 2)
    monkeypatch.setattr(blocks, "_MIN_BLOCKS", 1)
    monkeypatch.setattr(blocks, "fresh_pages", lambda nbytes: pieces)


def _rnd(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.randn(*shape) * 0.5).to(dtype)


#: Every accepted modulation shape, built in a given dtype.
MODULATIONS = {
    "python": lambda dt: 0.3,
    "zero_dim": lambda dt: torch.tensor(0.3, dtype=dt),
    "vector": lambda dt: _rnd(C, dtype=dt),
    "batch": lambda dt: _rnd(B, 1, C, dtype=dt),
    "shared": lambda dt: _rnd(1, 1, C, dtype=dt),
    "token": lambda dt: _rnd(B, L, C, dtype=dt),
    "frame": lambda dt: _rnd(B, FRAMES, 1, C, dtype=dt),
    "none": lambda dt: None,
}
#: (activation dtype, modulation dtype)
DTYPE_MIXES = [
    (torch.bfloat16, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float32),
    (torch.float16, torch.float16),
    (torch.float32, torch.float32),
]
MIX_IDS = ["bf16-fp32", "bf16-bf16", "fp16-fp32", "fp16-fp16", "fp32-fp32"]


def _bcast(h: torch.Tensor, m: object) -> tuple[torch.Tensor, object]:
    """h [B, L, C] and a modulation as eager combines them (per frame: unflatten L)."""
    if isinstance(m, torch.Tensor) and m.dim() == 4:
        return h.unflatten(1, (m.shape[1], -1)), m
    return h, m


def eager_norm(
    h: torch.Tensor,
    w: torch.Tensor | None,
    b: torch.Tensor | None,
    scale: Any,
    shift: Any,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``(LN(h.float()) * (1 + scale) + shift).to(out_dtype)``, Wan's expression."""
    y = F.layer_norm(h.float(), (C,), w, b, EPS)
    if scale is not None:
        y4, s = _bcast(y, scale)
        y = (y4 * (1 + s)).reshape(y.shape)
    if shift is not None:
        y4, t = _bcast(y, shift)
        y = (y4 + t).reshape(y.shape)
    return y.to(out_dtype)


def eager_gated(residual: torch.Tensor, x: torch.Tensor, gate: Any) -> torch.Tensor:
    """``(residual.float() + x * gate).type_as(residual)``, Wan's expression."""
    if gate is None:
        return (residual.float() + x).type_as(residual)
    x4, g = _bcast(x, gate)
    r4, _ = _bcast(residual, gate)
    return (r4.float() + x4 * g).type_as(residual).reshape(residual.shape)


def _mods(x3: torch.Tensor, **values: object) -> dict[str, shapes.Modulation]:
    dts = (torch.float32, x3.dtype)
    return {n: shapes.check_modulation(v, x3, "test", n, dts) for n, v in values.items()}


def _operands(x3: torch.Tensor, **values: object) -> dict[str, torch.Tensor | None]:
    return {n: shapes.exact_operand(m, x3) for n, m in _mods(x3, **values).items()}


def _affine(affine: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    return (_rnd(C) + 1, _rnd(C)) if affine else (None, None)


# --- exact: bitwise the eager expressions -------------------------------------------------


@pytest.mark.parametrize("affine", [False, True], ids=["plain", "affine"])
@pytest.mark.parametrize("mix", DTYPE_MIXES, ids=MIX_IDS)
@pytest.mark.parametrize("kind", list(MODULATIONS))
def test_exact_layer_norm_scale_shift(
    small_blocks: None, kind: str, mix: tuple[torch.dtype, torch.dtype], affine: bool
) -> None:
    act, mod = mix
    x = torch.randn(B, L, C).to(act) * 2 + 0.5
    w, b = _affine(affine)
    scale, shift = MODULATIONS[kind](mod), MODULATIONS["batch" if kind != "none" else kind](mod)
    ops = _operands(x, scale=scale, shift=shift)
    out = K.layer_norm_scale_shift(x, w, b, ops["scale"], ops["shift"], EPS, act, True)
    assert_exact(out, eager_norm(x, w, b, scale, shift, act))


@pytest.mark.parametrize("mix", DTYPE_MIXES, ids=MIX_IDS)
@pytest.mark.parametrize("kind", list(MODULATIONS))
def test_exact_gated_residual(
    small_blocks: None, kind: str, mix: tuple[torch.dtype, torch.dtype]
) -> None:
    act, mod = mix
    residual, x = torch.randn(B, L, C).to(act), torch.randn(B, L, C).to(act)
    gate = MODULATIONS[kind](mod)
    ops = _operands(residual, gate=gate)
    out = K.gated_residual(residual, x, ops["gate"], True)
    assert_exact(out, eager_gated(residual, x, gate))


@pytest.mark.parametrize("affine", [False, True], ids=["plain", "affine"])
@pytest.mark.parametrize("mix", DTYPE_MIXES, ids=MIX_IDS)
@pytest.mark.parametrize("kind", list(MODULATIONS))
def test_exact_fused(
    small_blocks: None, kind: str, mix: tuple[torch.dtype, torch.dtype], affine: bool
) -> None:
    act, mod = mix
    residual, x = torch.randn(B, L, C).to(act), torch.randn(B, L, C).to(act)
    w, b = _affine(affine)
    # The modulation under test as gate and as scale, a per-sample one as shift.
    gate = MODULATIONS[kind](mod)
    scale = MODULATIONS[kind](mod)
    shift = None if kind == "none" else _rnd(B, 1, C, dtype=mod)
    ops = _operands(residual, gate=gate, scale=scale, shift=shift)
    out, new_res = K.scale_residual_layer_norm_scale_shift(
        residual, x, ops["gate"], w, b, ops["scale"], ops["shift"], EPS, act, True
    )
    ref_res = eager_gated(residual, x, gate)
    assert_exact(new_res, ref_res)
    assert_exact(out, eager_norm(ref_res, w, b, scale, shift, act))


def test_exact_fp32_activations_with_low_precision_output(small_blocks: None) -> None:
    # Wan's FFN residual: x = ff_output.float(); out_dtype differs from x's.
    residual = torch.randn(B, L, C).bfloat16()
    x = torch.randn(B, L, C)
    gate, scale, shift = _rnd(B, 1, C), _rnd(B, 1, C), _rnd(B, 1, C)
    ops = _operands(residual, gate=gate, scale=scale, shift=shift)
    out, new_res = K.scale_residual_layer_norm_scale_shift(
        residual, x, ops["gate"], None, None, ops["scale"], ops["shift"], EPS, torch.float16, True
    )
    ref_res = eager_gated(residual, x, gate)
    assert_exact(new_res, ref_res)
    assert_exact(out, eager_norm(ref_res, None, None, scale, shift, torch.float16))


def test_exact_strided_activations(small_blocks: None) -> None:
    big = torch.randn(B, 2 * L, 2 * C).bfloat16()
    x = big[:, ::2, C:]  # row stride 4C, and every other row
    scale, shift = _rnd(B, L, 2 * C)[..., ::2], _rnd(B, 1, C)
    ops = _operands(x, scale=scale, shift=shift)
    out = K.layer_norm_scale_shift(x, None, None, ops["scale"], ops["shift"], EPS, x.dtype, True)
    assert_exact(out, eager_norm(x, None, None, scale, shift, x.dtype))
    assert out.is_contiguous()


def test_exact_nan_inf_and_empty(small_blocks: None) -> None:
    x = torch.randn(B, L, C).bfloat16()
    x[0, 3, 5] = float("nan")
    x[1, 7, 0] = float("inf")
    scale = _rnd(B, 1, C)
    scale[0, 0, 9] = float("inf")
    ops = _operands(x, scale=scale)
    out = K.layer_norm_scale_shift(x, None, None, ops["scale"], None, EPS, x.dtype, True)
    assert_exact(out, eager_norm(x, None, None, scale, None, x.dtype))
    empty = torch.empty(B, 0, C, dtype=torch.bfloat16)
    for exact in (True, False):
        assert K.layer_norm_scale_shift(
            empty, None, None, None, None, EPS, empty.dtype, exact
        ).shape == (B, 0, C)
        assert K.gated_residual(empty, empty, None, exact).shape == (B, 0, C)
        out, res = K.scale_residual_layer_norm_scale_shift(
            empty, empty, None, None, None, None, None, EPS, torch.float32, exact
        )
        assert out.shape == res.shape == (B, 0, C) and out.dtype == torch.float32


# --- fast: within the tolerance -----------------------------------------------------------


@pytest.mark.parametrize("mix", DTYPE_MIXES[:4], ids=MIX_IDS[:4])
@pytest.mark.parametrize("kind", ["python", "zero_dim", "vector", "batch", "token", "frame"])
def test_fast_within_tolerance(
    small_blocks: None, kind: str, mix: tuple[torch.dtype, torch.dtype]
) -> None:
    act, mod = mix
    residual, x = torch.randn(B, L, C).to(act), torch.randn(B, L, C).to(act)
    w, b = _affine(True)
    gate = scale = MODULATIONS[kind](mod)
    shift = _rnd(B, 1, C, dtype=mod)
    ops = _operands(residual, gate=gate, scale=scale, shift=shift)
    out = K.layer_norm_scale_shift(x, w, b, ops["scale"], ops["shift"], EPS, act, False)
    assert_fast(out, eager_norm(x, w, b, scale, shift, act), atol=ATOL)
    new_res = K.gated_residual(residual, x, ops["gate"], False)
    ref_res = eager_gated(residual, x, gate)
    assert_exact(new_res, ref_res)  # the fast gated residual is the exact one
    out, new_res = K.scale_residual_layer_norm_scale_shift(
        residual, x, ops["gate"], w, b, ops["scale"], ops["shift"], EPS, act, False
    )
    assert_exact(new_res, ref_res)
    assert_fast(out, eager_norm(ref_res, w, b, scale, shift, act), atol=ATOL)


@pytest.mark.parametrize("kind", ["batch", "token"])
@pytest.mark.parametrize("act", [torch.bfloat16, torch.float16])
def test_fast_differs_on_few_elements(kind: str, act: torch.dtype) -> None:
    # The rate half of the contract, on enough elements to measure it (default blocks).
    n, c = 256, 1024
    x = (torch.randn(2, n, c) * 3 + 1).to(act)
    scale = torch.randn(2, 1 if kind == "batch" else n, c) * 0.5
    shift = torch.randn(2, 1 if kind == "batch" else n, c) * 0.5
    out = K.layer_norm_scale_shift(x, None, None, scale, shift, EPS, act, False)
    y = F.layer_norm(x.float(), (c,), None, None, EPS)
    assert_fast(out, (y * (1 + scale) + shift).to(act), slack=0, atol=ATOL)


def test_fast_fp32_output_is_exact(small_blocks: None) -> None:
    x = torch.randn(B, L, C).bfloat16()
    scale, shift = _rnd(B, 1, C), _rnd(B, 1, C)
    out = K.layer_norm_scale_shift(x, None, None, scale, shift, EPS, torch.float32, False)
    assert_exact(out, eager_norm(x, None, None, scale, shift, torch.float32))


def test_fast_folds_one_layer_norm_call_for_shared_modulation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # [1, 1, C] modulation, B > 1: one mixed-dtype LayerNorm over every row, no blocks.
    calls = []
    real = F.layer_norm

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(K.F, "layer_norm", counting)
    x = torch.randn(B, L, C).bfloat16()
    K.layer_norm_scale_shift(
        x, None, None, _rnd(1, 1, C), _rnd(C).view(1, 1, C), EPS, x.dtype, False
    )
    assert calls == [torch.Size([B, L, C])]


# --- both LayerNorm plans give the same bits ----------------------------------------------


@pytest.mark.parametrize("mix", DTYPE_MIXES, ids=MIX_IDS)
def test_fast_is_the_same_with_either_plan(
    monkeypatch: pytest.MonkeyPatch, mix: tuple[torch.dtype, torch.dtype]
) -> None:
    # Fast mode is not eager's bits, but the plan (a LayerNorm call per block or per
    # piece) must not change them. 30 tokens in 3 frames, blocks of up to 12 rows, pieces
    # of 2 fp32 rows or 4 low-precision ones (the folded LayerNorm): ragged pieces too.
    act, mod = mix
    nb, nl, nf = 2, 30, 3
    monkeypatch.setattr(K, "_BLOCK_BYTES", 4 * C * 13)
    monkeypatch.setattr(blocks, "PIECE_BYTES", 4 * C * 2)
    monkeypatch.setattr(blocks, "_MIN_BLOCKS", 1)
    plan = {"fresh": False}
    monkeypatch.setattr(blocks, "fresh_pages", lambda nbytes: plan["fresh"])
    shaped: dict[str, tuple[int, ...]] = {
        "python": (),
        "zero_dim": (),
        "vector": (C,),
        "batch": (nb, 1, C),
        "shared": (1, 1, C),
        "token": (nb, nl, C),
        "frame": (nb, nf, 1, C),
    }
    residual, x = torch.randn(nb, nl, C).to(act), torch.randn(nb, nl, C).to(act)
    w, b = _affine(True)
    for kind, shape in shaped.items():
        g, s, t = (
            0.3 if kind == "python" else (torch.randn(shape) * 0.5).to(mod) for _ in range(3)
        )
        ops = _operands(x, gate=g, scale=s, shift=t)
        args = (ops["scale"], ops["shift"], EPS, act, False)
        results = []
        for fresh in (False, True):
            plan["fresh"] = fresh
            results.append(
                (
                    K.layer_norm_scale_shift(x, w, b, *args),
                    *K.scale_residual_layer_norm_scale_shift(residual, x, ops["gate"], w, b, *args),
                )
            )
        for whole, pieces in zip(*results, strict=True):
            assert_exact(pieces, whole)


# --- the custom ops ---------------------------------------------------------------------


def test_custom_ops_pass_opcheck() -> None:
    x, r = torch.randn(2, 6, 16).bfloat16(), torch.randn(2, 6, 16).bfloat16()
    g, s, t = torch.randn(2, 1, 16), torch.randn(1, 6, 16), torch.tensor(0.5, dtype=torch.float64)
    w = torch.randn(16)
    for exact in (True, False):
        torch.library.opcheck(
            K.layer_norm_scale_shift.op, (x, w, None, s, t, EPS, torch.bfloat16, exact)
        )
        torch.library.opcheck(K.gated_residual.op, (r, x, g, exact))
        torch.library.opcheck(
            K.scale_residual_layer_norm_scale_shift.op,
            (r, x, g, None, w, s, t, EPS, torch.float16, exact),
        )


# --- shape normalisation ----------------------------------------------------------------


def test_rows3_takes_2d_as_batch_one() -> None:
    x = torch.randn(5, 8)
    assert shapes.rows3(x, "op").shape == (1, 5, 8)
    assert shapes.rows3(x, "op").data_ptr() == x.data_ptr()
    with pytest.raises(ValueError, match=r"\[B, L, C\] or \[L, C\]"):
        shapes.rows3(torch.randn(2, 2, 2, 8), "op")
    with pytest.raises(TypeError, match="int64"):
        shapes.rows3(torch.ones(2, 8, dtype=torch.int64), "op")


@pytest.mark.parametrize(
    ("value", "rows_shape", "groups"),
    [
        (0.5, (1, 1, C), 1),
        (torch.tensor(0.5), (1, 1, C), 1),
        (torch.randn(C), (1, 1, C), 1),
        (torch.randn(B, 1, C), (B, 1, C), 1),
        (torch.randn(1, L, C), (1, L, C), L),
        (torch.randn(B, FRAMES, 1, C), (B, FRAMES, C), FRAMES),
    ],
    ids=["python", "zero_dim", "vector", "batch", "token_shared", "frame"],
)
def test_modulation_rows_are_views(value: object, rows_shape: tuple[int, ...], groups: int) -> None:
    x = torch.randn(B, L, C)
    mod = shapes.check_modulation(value, x, "op", "scale", (torch.float32,))
    assert mod.groups == groups
    rows = shapes.modulation_rows(mod, x)
    assert rows is not None and rows.shape == rows_shape
    if isinstance(value, torch.Tensor):
        assert rows.data_ptr() == value.data_ptr()  # a view, never a copy
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        assert rows.stride(-1) == 0  # a scalar broadcast over C


def test_exact_operand_keeps_scalars_scalar() -> None:
    x = torch.randn(B, L, C).bfloat16()
    for value in (0.5, 2, torch.tensor(0.5)):
        op = shapes.exact_operand(shapes.check_modulation(value, x, "op", "g", (torch.float32,)), x)
        assert op is not None and op.dim() == 0
        # the same promotion as the scalar itself: bf16 x times a scalar stays bf16
        assert torch.result_type(x, op) == torch.result_type(x, value)


@pytest.mark.parametrize(
    ("shape", "match"),
    [
        ((C + 1,), "last dim 41 != C = 40"),
        ((B, C), "rank 2 is not accepted"),
        ((3, 1, C), "leading dim 3 is neither 1 nor B = 2"),
        ((B, 5, C), "expected 1 \\(per sample\\) or L = 12"),
        ((B, 5, 1, C), "L = 12 is not divisible by F = 5"),
        ((B, 3, 2, C), "dim 2 is 2, not 1"),
        ((1, B, 1, 1, C), "rank 5"),
    ],
)
def test_bad_modulation_shapes_name_the_accepted_ones(shape: tuple[int, ...], match: str) -> None:
    x = torch.randn(B, L, C)
    with pytest.raises(ValueError, match=match) as info:
        shapes.check_modulation(torch.randn(shape), x, "op", "scale", (torch.float32,))
    assert shapes.ACCEPTED_SHAPES in str(info.value)


def test_bad_modulation_types() -> None:
    x = torch.randn(B, L, C).bfloat16()
    allowed = (torch.float32, torch.bfloat16)
    with pytest.raises(TypeError, match="float16; expected float32 or bfloat16"):
        shapes.check_modulation(torch.randn(C).half(), x, "op", "scale", allowed)
    with pytest.raises(TypeError, match="got bool"):
        shapes.check_modulation(True, x, "op", "gate", allowed)
    with pytest.raises(TypeError, match="got str"):
        shapes.check_modulation("1", x, "op", "gate", allowed)
    with pytest.raises(TypeError, match="int64"):
        shapes.check_modulation(torch.ones(C, dtype=torch.int64), x, "op", "gate", allowed)


def test_per_frame_and_per_token_must_agree() -> None:
    x = torch.randn(B, L, C)
    mods = {
        "scale": shapes.check_modulation(
            torch.randn(B, 3, 1, C), x, "op", "scale", (torch.float32,)
        ),
        "shift": shapes.check_modulation(
            torch.randn(B, 4, 1, C), x, "op", "shift", (torch.float32,)
        ),
        "gate": shapes.check_modulation(torch.randn(B, 1, C), x, "op", "gate", (torch.float32,)),
    }
    with pytest.raises(ValueError, match="scale has 3, shift has 4"):
        shapes.common_groups("op", mods, L)
    del mods["shift"]
    assert shapes.common_groups("op", mods, L) == 3
