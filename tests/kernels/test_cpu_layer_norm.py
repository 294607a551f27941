"""The exact CPU FP32LayerNorm kernel on many blocks, with both LayerNorm plans.

``whole``: one LayerNorm call per block (what a recycling allocator gets); ``pieces``:
LayerNorm on pieces of a block, into the output (what fresh pages get). Both must be
bitwise the meaning, ``F.layer_norm(x.float(), ...).to(x.dtype)``. Blocks are made 5 rows
long and pieces 2 rows, so every case walks several blocks and ragged ends.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from ditops.kernels.cpu import blocks
from ditops.kernels.cpu import layer_norm as LN
from tests.precision import assert_exact

EPS = 1e-6
Plan = Callable[[int], None]


@pytest.fixture(params=["whole", "pieces"])
def plan(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Plan:
    """``plan(row_len)`` sets blocks of 5 rows and pieces of 2 (or none) for that row length."""
    pieces = request.param == "pieces"
    monkeypatch.setattr(blocks, "_MIN_BLOCKS", 1)
    monkeypatch.setattr(blocks, "fresh_pages", lambda nbytes: pieces)

    def set_rows(row_len: int) -> None:
        monkeypatch.setattr(LN, "_BLOCK_BYTES", 4 * row_len * 5)
        monkeypatch.setattr(blocks, "PIECE_BYTES", 4 * row_len * 2)

    return set_rows


def meaning(
    x: torch.Tensor, shape: list[int], w: torch.Tensor | None, b: torch.Tensor | None
) -> torch.Tensor:
    return F.layer_norm(x.float(), shape, w, b, EPS).to(x.dtype)


def _params(shape: list[int], affine: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    w = torch.randn(shape) if affine != "none" else None
    b = torch.randn(shape) if affine == "affine" else None
    return w, b


@pytest.mark.parametrize("affine", ["affine", "weight", "none"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    ("x_shape", "norm_shape"),
    [((37, 7), [7]), ((50, 1000), [1000]), ((3, 13, 96), [96]), ((3, 9, 4, 25), [4, 25])],
    ids=["odd", "wide", "3d", "multi_dim"],
)
def test_exact_is_the_meaning(
    plan: Plan,
    x_shape: tuple[int, ...],
    norm_shape: list[int],
    dtype: torch.dtype,
    affine: str,
) -> None:
    row_len = 1
    for d in norm_shape:
        row_len *= d
    plan(row_len)
    x = (torch.randn(x_shape) * 3 + 1).to(dtype)
    w, b = _params(norm_shape, affine)
    out = LN.fp32_layer_norm(x, norm_shape, w, b, EPS, True)
    assert_exact(out, meaning(x, norm_shape, w, b))


def test_exact_strided_inputs(plan: Plan) -> None:
    plan(96)
    w, b = _params([96], "affine")
    sliced = torch.randn(23, 200, dtype=torch.bfloat16)[:, 50:146]
    transposed = torch.randn(96, 8, 5, dtype=torch.bfloat16).permute(1, 2, 0)
    every_other = torch.randn(46, 96, dtype=torch.bfloat16)[::2]
    for x in (sliced, transposed, every_other):
        assert not x.is_contiguous()
        assert_exact(LN.fp32_layer_norm(x, [96], w, b, EPS, True), meaning(x, [96], w, b))


def test_exact_nan_and_inf(plan: Plan) -> None:
    plan(64)
    x = torch.randn(21, 64, dtype=torch.bfloat16)
    x[3, 5], x[11, 0], x[20, 63] = float("nan"), float("inf"), -float("inf")
    w, b = _params([64], "affine")
    assert_exact(LN.fp32_layer_norm(x, [64], w, b, EPS, True), meaning(x, [64], w, b))


@pytest.mark.parametrize(("pieces", "calls"), [(False, 8), (True, 19)], ids=["whole", "pieces"])
def test_plans_call_layer_norm_per_block_or_per_piece(
    monkeypatch: pytest.MonkeyPatch, pieces: bool, calls: int
) -> None:
    # 37 rows: blocks of 5 rows (8 calls), or blocks of 4 in pieces of 2 (9 * 2 + 1).
    monkeypatch.setattr(blocks, "_MIN_BLOCKS", 1)
    monkeypatch.setattr(blocks, "fresh_pages", lambda nbytes: pieces)
    monkeypatch.setattr(LN, "_BLOCK_BYTES", 4 * 7 * 5)
    monkeypatch.setattr(blocks, "PIECE_BYTES", 4 * 7 * 2)
    x = torch.randn(37, 7, dtype=torch.bfloat16)
    ref = meaning(x, [7], None, None)
    rows: list[int] = []
    real = torch.layer_norm

    def counting(x: torch.Tensor, *args: object) -> torch.Tensor:
        rows.append(x.shape[0])
        return real(x, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "layer_norm", counting)
    assert_exact(LN.fp32_layer_norm(x, [7], None, None, EPS, True), ref)
    assert len(rows) == calls and sum(rows) == 37
    assert max(rows) == (2 if pieces else 5)


def test_one_row_wider_than_a_piece_runs_whole_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    # A row whose LayerNorm output alone exceeds PIECE_BYTES gains nothing from pieces.
    monkeypatch.setattr(blocks, "PIECE_BYTES", 64)
    monkeypatch.setattr(blocks, "_MIN_BLOCKS", 1)
    monkeypatch.setattr(blocks, "fresh_pages", lambda nbytes: True)
    assert blocks.piece_rows(100, 10, 4 * 32) == 10
    assert blocks.piece_rows(100, 10, 4 * 8) == 2
    monkeypatch.setattr(blocks, "_MIN_BLOCKS", 4)
    assert blocks.piece_rows(30, 10, 4 * 8) == 10  # three blocks: not worth a probe
