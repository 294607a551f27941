"""Layouts of attention tensors, and how the references chunk their work."""

from __future__ import annotations

import torch

LAYOUTS = ("BNSD", "BSND")
#: fp32 scores the references hold at once (16 MiB): enough to keep matmuls efficient,
#: small enough to stay in the caches and never allocate an ``S x S`` matrix.
CHUNK_ELEMENTS = 1 << 22


def to_bnsd(x: torch.Tensor, layout: str) -> torch.Tensor:
    """A ``[B, N, S, D]`` view of a tensor in ``layout`` (no copy)."""
    if layout == "BNSD":
        return x
    if layout == "BSND":
        return x.transpose(1, 2)
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def plan_chunks(
    heads: int, rows: int, cols: int, row_multiple: int, budget: int = CHUNK_ELEMENTS
) -> tuple[int, int]:
    """(heads, rows) per chunk so that ``heads * rows * cols <= budget`` scores.

    Rows come in multiples of ``row_multiple`` (whole query blocks); one such group of
    one head is the minimum whatever the budget (a 128-row block at 32k keys holds 4M
    scores).
    """
    per_head = max(rows * cols, 1)
    if per_head <= budget:
        return max(1, min(heads, budget // per_head)), rows
    chunk = max(1, budget // max(cols, 1) // row_multiple) * row_multiple
    return 1, min(rows, chunk)
