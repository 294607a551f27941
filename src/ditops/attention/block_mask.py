"""Block masks: the dense 0/1 representation, its validator, FlexAttention conversion, stats.

A block mask says, for every (batch, query head, query block), which key blocks a
query block attends to. ditops keeps it the way the Ascend operators take it
(``docs/npu.md``, "The kernels' contract"):

- ``mask``: int8 (or bool) ``[B, N, Qb, >= KVb]`` of 0/1, ``Qb = ceil(Sq / block)``,
  ``KVb = ceil(Skv / block)``; columns past ``KVb`` (the NPU pads to a multiple of 32)
  must be 0. ``N`` is the number of *query* heads.
- ``counts``: int32 ``[B, N, Qb]``, the row sums of ``mask``.

The last block of a sequence whose length is not a multiple of the block size is
partial: its padding positions are never keys and never produce outputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

MASK_DTYPES = (torch.int8, torch.bool)


def num_blocks(length: int, block_size: int) -> int:
    """How many blocks of ``block_size`` cover ``length`` positions (the last may be partial)."""
    return math.ceil(length / block_size)


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(s) for s in t.shape)


def validate_block_mask(
    mask: torch.Tensor,
    counts: torch.Tensor,
    *,
    batch: int,
    heads: int,
    q_blocks: int,
    kv_blocks: int,
    check_values: bool = True,
) -> None:
    """Raise a ValueError/TypeError naming what is wrong with ``mask``/``counts``.

    Shapes and dtypes are always checked. With ``check_values`` the values are read too
    (0/1 only, zero padding columns, counts equal to row sums): that reads the tensors,
    so on an accelerator it waits for them.
    """
    if not isinstance(mask, torch.Tensor) or not isinstance(counts, torch.Tensor):
        raise TypeError(
            "block mask: mask and counts must be tensors, got "
            f"{type(mask).__name__} and {type(counts).__name__}"
        )
    if mask.dtype not in MASK_DTYPES:
        raise TypeError(f"block mask: mask dtype must be int8 (0/1) or bool, got {mask.dtype}")
    if counts.dtype != torch.int32:
        raise TypeError(f"block mask: counts dtype must be int32, got {counts.dtype}")
    want = (batch, heads, q_blocks)
    if mask.dim() != 4 or _shape(mask)[:3] != want or mask.shape[3] < kv_blocks:
        raise ValueError(
            f"block mask: mask shape must be [B, N, Qb, >=KVb] = [{batch}, {heads}, {q_blocks}, "
            f">={kv_blocks}] for these inputs, got {list(_shape(mask))}"
        )
    if _shape(counts) != want:
        raise ValueError(
            f"block mask: counts shape must be [B, N, Qb] = {list(want)}, "
            f"got {list(_shape(counts))}"
        )
    if mask.device != counts.device:
        raise ValueError(f"block mask: mask is on {mask.device} but counts are on {counts.device}")
    if not check_values:
        return
    if mask.dtype == torch.int8:
        bad = (mask != 0) & (mask != 1)
        if bool(bad.any()):
            raise ValueError(
                f"block mask: mask values must be 0 or 1; found {int(bad.sum())} other values "
                f"(e.g. {int(mask[bad][0])})"
            )
    if mask.shape[3] > kv_blocks and bool(mask[..., kv_blocks:].any()):
        raise ValueError(
            f"block mask: columns past kv_blocks={kv_blocks} are padding and must be 0"
        )
    sums = mask[..., :kv_blocks].sum(-1, dtype=torch.int32)
    wrong = sums != counts
    if bool(wrong.any()):
        where = [int(i) for i in wrong.nonzero()[0]]
        raise ValueError(
            f"block mask: counts must equal the row sums of mask; {int(wrong.sum())} rows "
            f"differ, first at [b, n, qb] = {where}: count {int(counts[tuple(where)])}, "
            f"row sum {int(sums[tuple(where)])}"
        )


def row_counts(mask: torch.Tensor, kv_blocks: int | None = None) -> torch.Tensor:
    """The int32 count table of ``mask``: its row sums over the first ``kv_blocks`` columns."""
    m = mask if kv_blocks is None else mask[..., :kv_blocks]
    return m.sum(-1, dtype=torch.int32)


def causal_candidates(
    q_blocks: int, kv_blocks: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Bool ``[Qb, KVb]``: key blocks a query block can see under a causal mask.

    Causal is aligned at the top left (query i sees keys j <= i, like SDPA's
    ``is_causal``), so query block ``r`` sees key blocks ``0..r``.
    """
    rows = torch.arange(q_blocks, device=device)[:, None]
    cols = torch.arange(kv_blocks, device=device)[None, :]
    return cols <= rows


def to_flex_block_mask(
    mask: torch.Tensor,
    counts: torch.Tensor,
    *,
    q_len: int,
    kv_len: int,
    block_size: int,
    causal: bool = False,
) -> BlockMask:
    """The FlexAttention ``BlockMask`` selecting the same blocks (forward only).

    Selected blocks are passed as *full* blocks, which skip ``mask_mod`` (FlexAttention
    still stops at ``kv_len``). Under ``causal`` the blocks left of the diagonal are
    full, the diagonal block is partial (``mask_mod`` is ``q >= kv``) and the blocks
    right of it, which no query sees, are dropped. Measured on CPU
    (``benchmarks/cpu/probes/sparse_attention_cpu.py --flex-options``): the same speed as
    partial blocks without ``causal``, about twice as fast with it. torch 2.13 compiles
    full blocks on CPU, whatever an earlier note said (minimal repro:
    ``benchmarks/cpu/probes/flex_full_blocks.py``; the ``cuda``-path tests compile them
    on CPU tensors too). No query-side indices are built (``compute_q_blocks=False``):
    no backward.

    ``counts`` are the row sums of ``mask`` (validated by the op); the block lists are
    rebuilt from ``mask`` here.

    ``mask_mod`` also says which blocks are selected (element ``(q, kv)`` is kept when
    its block is), although compiled kernels never evaluate it on full blocks: eager
    FlexAttention (what runs when torch.compile does not, e.g. ``TORCHDYNAMO_DISABLE=1``
    or ``torch.compiler.set_stance("force_eager")``) reads the ``mask_mod`` only, not the
    block lists, and would otherwise attend to every key.
    """
    from torch.nn.attention.flex_attention import BlockMask

    kv_blocks = num_blocks(kv_len, block_size)
    full = mask[..., :kv_blocks].to(torch.int8)
    partial = torch.zeros_like(full)
    if causal:
        rows = torch.arange(full.shape[-2], device=full.device)[:, None]
        cols = torch.arange(kv_blocks, device=full.device)[None, :]
        partial = full * (cols == rows)
        full = full * (cols < rows)
    return BlockMask.from_kv_blocks(
        row_counts(partial),
        _selected_first(partial),
        row_counts(full),
        _selected_first(full),
        BLOCK_SIZE=block_size,
        mask_mod=_selection_mask_mod(mask[..., :kv_blocks].bool(), block_size, causal),
        seq_lengths=(q_len, kv_len),
        compute_q_blocks=False,
    )


def _selected_first(mask: torch.Tensor) -> torch.Tensor:
    """int32 block ids per row, selected ones first in ascending order (a stable sort of
    the 1s before the 0s); the entries past the row's count are never read."""
    return torch.argsort(mask, dim=-1, descending=True, stable=True).to(torch.int32)


def _selection_mask_mod(selected: torch.Tensor, block_size: int, causal: bool) -> Any:
    """FlexAttention ``mask_mod``: keep ``(q, kv)`` when its block is ``selected``
    (``[B or 1, N, Qb, KVb]`` bool) and, under ``causal``, ``q >= kv``."""
    one_batch = int(selected.shape[0]) == 1

    def mask_mod(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        keep = selected[0 if one_batch else b, h, q_idx // block_size, kv_idx // block_size]
        return keep & (q_idx >= kv_idx) if causal else keep

    return mask_mod


def _block_sizes(length: int, block_size: int, device: torch.device) -> torch.Tensor:
    """Real positions in each block (the last one may be partial), as float64."""
    starts = torch.arange(num_blocks(length, block_size), device=device) * block_size
    return (length - starts).clamp(max=block_size).to(torch.float64)


@dataclass(frozen=True)
class MaskDensity:
    """How much of the attention a block mask keeps.

    ``density`` counts *tokens* (query x key pairs, partial blocks at their real size,
    within the causal triangle's blocks when ``causal``) kept over those possible, so
    it is the fraction of a dense attention's work the sparse one does.
    """

    density: float
    block_density: float
    per_head: list[float]
    mean_blocks_per_row: float
    min_blocks_per_row: int
    max_blocks_per_row: int
    empty_rows: int

    def as_dict(self) -> dict[str, object]:
        return {
            "density": self.density,
            "block_density": self.block_density,
            "per_head": self.per_head,
            "mean_blocks_per_row": self.mean_blocks_per_row,
            "min_blocks_per_row": self.min_blocks_per_row,
            "max_blocks_per_row": self.max_blocks_per_row,
            "empty_rows": self.empty_rows,
        }


def density_stats(
    mask: torch.Tensor,
    *,
    q_len: int,
    kv_len: int,
    block_size: int,
    causal: bool = False,
) -> MaskDensity:
    """Density statistics of a ``[B, N, Qb, >=KVb]`` block mask (see :class:`MaskDensity`)."""
    q_blocks, kv_blocks = num_blocks(q_len, block_size), num_blocks(kv_len, block_size)
    m = mask[..., :kv_blocks].to(torch.float64)
    dev = mask.device
    area = _block_sizes(q_len, block_size, dev)[:, None] * _block_sizes(kv_len, block_size, dev)
    possible = torch.ones(q_blocks, kv_blocks, dtype=torch.float64, device=dev)
    if causal:
        possible = causal_candidates(q_blocks, kv_blocks, dev).to(torch.float64)
        m = m * possible
    kept_tokens = (m * area).sum(dim=(0, 2, 3))
    total_tokens = (possible * area).sum() * m.shape[0]
    per_head = (kept_tokens / total_tokens).tolist()
    counts = m.sum(-1)
    return MaskDensity(
        density=float(kept_tokens.sum() / (total_tokens * m.shape[1])),
        block_density=float(m.sum() / (possible.sum() * m.shape[0] * m.shape[1])),
        per_head=[float(x) for x in per_head],
        mean_blocks_per_row=float(counts.mean()),
        min_blocks_per_row=int(counts.min()),
        max_blocks_per_row=int(counts.max()),
        empty_rows=int((counts == 0).sum()),
    )
