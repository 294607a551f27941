"""Which blocks an estimate keeps: the selection settings and the in-budget reading.

:class:`BlockSelection` is the one value the selection settings travel as (the op
``estimate_block_mask``, its reference, every path and the budget below read it);
validated once, when made. The in-budget reading (ditops' default, see
:mod:`ditops.attention.estimate`) is here: the forced blocks, the budget split over the
rows (:func:`block_budget`), the masks that need no scores (:func:`mask_without_scores`)
and the selection from scores (:func:`select_in_budget`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

import torch

from ditops.attention.block_mask import causal_candidates, num_blocks, row_counts
from ditops.attention.methods import (
    DEFAULT_SAMPLES,
    METHODS,
    OP_DEFAULT_METHOD,
    POOLED_ALLOCATIONS,
    check_method,
    select_per_head,
    select_per_layer,
)
from ditops.core.checks import as_real, check_choice, check_flag, check_int
from ditops.tracing import traced

#: What ``keep_ratio`` means: the share of the map that runs, forced blocks included
#: (ditops), or a per-row cap on scored blocks with forced blocks on top (sglang).
FORCED_BLOCKS = ("in_budget", "on_top")

logger = logging.getLogger("ditops")


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class BlockSelection:
    """How an estimate selects blocks (see :mod:`ditops.attention.estimate`).

    ``threshold`` > 0: cumulative score mass kept per row (>= 1 keeps all);
    ``keep_ratio`` in (0, 1]: the share kept (read as ``forced_blocks`` says, one of
    :data:`FORCED_BLOCKS`); ``keep_sink``/``keep_recent``: key block 0 / the last
    candidate always kept; ``causal``: candidates up to the diagonal only;
    ``dense_blocks`` >= 0: leading block rows and columns forced on (the first video
    frame); ``method``/``samples``: how blocks are scored and the budget spent
    (:data:`ditops.attention.methods.METHODS`). ``mass`` in (0, 1] (or ``None``): a
    mass target instead of a density (:func:`select_by_mass`): each row (per-row
    methods) or each head on average over its rows (per-head methods) keeps blocks until
    that share of its estimated attention mass is covered, forced blocks counted; then
    ``keep_ratio`` must stay 1, ``threshold`` 1, ``forced_blocks="in_budget"``, and the
    method not ``"layer"``. ``where``: the name errors start with.
    """

    threshold: float = 1.0
    keep_ratio: float = 1.0
    keep_sink: bool = True
    keep_recent: bool = True
    causal: bool = False
    dense_blocks: int = 0
    forced_blocks: str = "in_budget"
    method: str = OP_DEFAULT_METHOD
    samples: int = DEFAULT_SAMPLES
    mass: float | None = None
    where: str = field(default="estimate_block_mask", compare=False, repr=False)

    def __post_init__(self) -> None:
        op = self.where
        if not _is_number(self.threshold) or not self.threshold > 0:
            raise ValueError(f"{op}: threshold must be a number > 0, got {self.threshold!r}")
        if not _is_number(self.keep_ratio) or not 0 < self.keep_ratio <= 1:
            raise ValueError(f"{op}: keep_ratio must be in (0, 1], got {self.keep_ratio!r}")
        for name in ("keep_sink", "keep_recent", "causal"):
            check_flag(op, name, getattr(self, name))
        check_int(op, "dense_blocks", self.dense_blocks, minimum=0)
        check_choice(op, "forced_blocks", self.forced_blocks, FORCED_BLOCKS)
        object.__setattr__(self, "threshold", float(self.threshold))
        object.__setattr__(self, "keep_ratio", float(self.keep_ratio))
        check_method(
            self.method,
            self.samples,
            forced_blocks=self.forced_blocks,
            threshold=self.threshold,
            where=op,
        )
        if self.mass is not None:
            object.__setattr__(self, "mass", check_mass(self, op))

    @property
    def scoring(self) -> str:
        """How the method scores blocks: ``"antidiagonal"`` or ``"sampled"``."""
        return METHODS[self.method][0]

    @property
    def allocation(self) -> str:
        """How the method spends the budget: ``"row"``, ``"head"`` or ``"layer"``."""
        return METHODS[self.method][1]

    @property
    def in_budget(self) -> bool:
        return self.forced_blocks == "in_budget"

    def replace(self, **changes: Any) -> BlockSelection:
        return dataclasses.replace(self, **changes)


def check_mass_value(mass: object, where: str) -> float:
    """``mass`` as a float in (0, 1], or a TypeError/ValueError saying what is valid."""
    value = as_real(mass)  # numpy's numbers and 0-d arrays too, as the other settings
    if value is None:
        raise TypeError(f"{where}: mass must be a number in (0, 1], got {mass!r}")
    if not 0.0 < value <= 1.0:  # False for NaN too
        raise ValueError(
            f"{where}: mass must be in (0, 1] (the share of each row's attention mass the "
            f"kept blocks cover; 1 keeps every block), got {mass!r}"
        )
    return value


def check_mass(sel: BlockSelection, where: str) -> float:
    """Validate a selection's mass target against its other settings (see
    :class:`BlockSelection`)."""
    mass = check_mass_value(sel.mass, where)
    if sel.keep_ratio != 1.0:
        raise ValueError(
            f"{where}: give keep_ratio (a density) or mass (a covered share of attention "
            f"mass), not both (got keep_ratio={sel.keep_ratio}, mass={mass})"
        )
    if sel.forced_blocks != "in_budget":
        raise ValueError(
            f"{where}: a mass target needs forced_blocks='in_budget' (forced blocks count "
            f"towards the mass covered), got {sel.forced_blocks!r}"
        )
    if sel.threshold < 1.0:
        raise ValueError(
            f"{where}: a mass target replaces threshold < 1 (got threshold={sel.threshold}); "
            "leave threshold at 1"
        )
    if sel.allocation == "layer":
        per_head = [m for m, (_, a) in METHODS.items() if a != "layer"]
        raise ValueError(
            f"{where}: a mass target is per head (or per row); method {sel.method!r} spends "
            f"one budget over a layer's heads: use one of {per_head}"
        )
    return mass


def selection_of(sel: BlockSelection | None, fields: dict[str, Any]) -> BlockSelection:
    """``sel``, or one made of keyword ``fields`` (callers outside the op: tests,
    benchmarks); not both."""
    if sel is None:
        return BlockSelection(**fields)
    if fields:
        raise TypeError(f"give a BlockSelection or its fields, not both (got {sorted(fields)})")
    return sel


# --- the in-budget reading: what runs is what was asked for ----------------------------


@dataclass(frozen=True)
class BlockBudget:
    """How ``keep_ratio`` of one head's block map splits (the same for every head).

    ``candidates``: blocks of the map (the causal triangle's under ``causal``);
    ``forced``: of those, the forced ones; ``total``: the budget,
    ``round(keep_ratio * candidates)``. The scalars are closed forms of the block counts
    (no loop over rows), so under torch.compile with dynamic shapes they stay symbolic
    and one graph serves every resolution. What each query block row keeps beyond its
    forced blocks: :meth:`row_shares` (a tensor, traceable) or :attr:`per_row` (host ints).
    """

    q_blocks: int
    kv_blocks: int
    candidates: int
    forced: int
    total: int
    sel: BlockSelection = field(repr=False)

    @property
    def forced_only(self) -> bool:
        """The forced blocks alone take the whole budget (or more)."""
        return self.forced >= self.total

    @property
    def density(self) -> float:
        """The block density that runs: ``max(total, forced) / candidates``."""
        return max(self.total, self.forced) / self.candidates if self.candidates else 0.0

    @property
    def min_density(self) -> float:
        """The smallest density reachable: the forced blocks' share of the map."""
        return self.forced / self.candidates if self.candidates else 0.0

    def row_shares(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Int64 ``[Qb]``: scored blocks each query block row keeps (all 0 when
        ``forced >= total``). What is left after the forced blocks is split in proportion
        to the rows' scored candidates; the largest remainders get the blocks the floors
        left over, earlier rows first on ties. Tensor ops only: traceable at any shape."""
        left = self.total - self.forced
        scorable = _scorable_per_row(self.q_blocks, self.kv_blocks, self.sel, device)
        if left <= 0:
            return torch.zeros_like(scorable)
        pool = self.candidates - self.forced  # >= left, as total <= candidates
        share = scorable * left
        floors = share // pool
        order = (share % pool).argsort(descending=True, stable=True)
        ranks = torch.arange(self.q_blocks, device=order.device)
        rank = torch.empty_like(order).scatter_(0, order, ranks)
        return floors + (rank < left - floors.sum()).to(floors.dtype)

    @property
    def per_row(self) -> tuple[int, ...]:
        """:meth:`row_shares` computed in host ints, with no tensor (eager callers that
        need Python numbers: the NPU kernel's ratio, tests). Needs int block counts."""
        left = self.total - self.forced
        if left <= 0:
            return (0,) * self.q_blocks
        pool = self.candidates - self.forced
        first = _first_scored_row(self.kv_blocks, self.sel)
        c = _forced_per_scored_row(self.sel)
        shares = []
        for r in range(self.q_blocks):
            n = min(r + 1, self.kv_blocks) if self.sel.causal else self.kv_blocks
            whole = r < first or (self.sel.causal and n <= 2)
            shares.append(0 if whole else max(n - c, 0) * left)
        per_row = [s // pool for s in shares]
        order = sorted(range(self.q_blocks), key=lambda r: (-(shares[r] % pool), r))
        for r in order[: left - sum(per_row)]:
            per_row[r] += 1
        return tuple(per_row)


def _forced_per_scored_row(sel: BlockSelection) -> int:
    """Forced blocks of a row that is not forced whole, when it has that many
    candidates or more: the first frame's columns (the sink among them; else the sink
    alone) and the recent block. A row with fewer candidates has all of them forced."""
    return (sel.dense_blocks if sel.dense_blocks > 0 else int(sel.keep_sink)) + int(sel.keep_recent)


def _first_scored_row(kv_blocks: int, sel: BlockSelection) -> int:
    """Rows before it are forced whole: the first frame's, and under ``causal`` the
    rows of at most two candidates (all of them when ``kv_blocks <= 2``)."""
    if not sel.causal:
        return sel.dense_blocks
    return max(sel.dense_blocks, 2)


def _scorable_per_row(
    q_blocks: int, kv_blocks: int, sel: BlockSelection, device: torch.device | str | None
) -> torch.Tensor:
    """Int64 ``[Qb]``: candidates of each row that are not forced (mirrors
    :func:`forced_block_mask`)."""
    rows = torch.arange(q_blocks, device=device)
    n = (rows + 1).clamp(max=kv_blocks) if sel.causal else torch.full_like(rows, kv_blocks)
    scored = (n - _forced_per_scored_row(sel)).clamp(min=0)
    whole = rows < _first_scored_row(kv_blocks, sel)
    if sel.causal:
        whole = whole | (n <= 2)
    return scored.masked_fill(whole, 0)


def _sum_scored(rows: int, kv_blocks: int, causal: bool, c: int) -> int:
    """``sum(max(n_j - c, 0) for j in 1..rows)`` with ``n_j`` the candidates of row
    ``j - 1`` (``kv_blocks``, or ``min(j, kv_blocks)`` under ``causal``), in closed form."""
    over = torch.sym_max(kv_blocks - c, 0)
    if not causal:
        return rows * over
    t = torch.sym_max(torch.sym_min(rows, kv_blocks) - c, 0)
    return t * (t + 1) // 2 + torch.sym_max(rows - kv_blocks, 0) * over


def block_budget(
    q_blocks: int, kv_blocks: int, sel: BlockSelection | None = None, **fields: Any
) -> BlockBudget:
    """Split ``sel.keep_ratio`` of the block map over its rows (see
    :mod:`ditops.attention.estimate`). ``fields``: see :func:`selection_of`.

    Closed forms of ``q_blocks``/``kv_blocks`` (ints, or SymInts under torch.compile with
    dynamic shapes): no loop over the rows, no sort of symbolic keys."""
    sel = selection_of(sel, fields)
    if sel.causal:
        full = torch.sym_min(q_blocks, kv_blocks)
        candidates = full * (full + 1) // 2 + torch.sym_max(q_blocks - kv_blocks, 0) * kv_blocks
    else:
        candidates = q_blocks * kv_blocks
    if sel.causal and kv_blocks <= 2:
        scorable = 0  # every row has at most two candidates: all forced
    else:
        c = _forced_per_scored_row(sel)
        first = torch.sym_min(_first_scored_row(kv_blocks, sel), q_blocks)
        scorable = _sum_scored(q_blocks, kv_blocks, sel.causal, c) - _sum_scored(
            first, kv_blocks, sel.causal, c
        )
    forced = candidates - scorable
    total = math.floor(sel.keep_ratio * candidates + 0.5)
    return BlockBudget(q_blocks, kv_blocks, candidates, forced, total, sel)


def candidate_blocks(
    q_blocks: int, kv_blocks: int, *, causal: bool, device: torch.device | str | None = None
) -> torch.Tensor:
    """Bool ``[Qb, KVb]``: every block, or the causal triangle's."""
    if causal:
        return causal_candidates(q_blocks, kv_blocks, device)
    return torch.ones(q_blocks, kv_blocks, dtype=torch.bool, device=device)


def forced_block_mask(
    q_blocks: int,
    kv_blocks: int,
    sel: BlockSelection | None = None,
    *,
    device: torch.device | str | None = None,
    **fields: Any,
) -> torch.Tensor:
    """Bool ``[Qb, KVb]``: the blocks the in-budget reading always keeps."""
    sel = selection_of(sel, fields)
    rows = torch.arange(q_blocks, device=device)[:, None]
    col = torch.arange(kv_blocks, device=device)[None, :]
    cand = candidate_blocks(q_blocks, kv_blocks, causal=sel.causal, device=device)
    n_cand = cand.sum(-1, keepdim=True)
    forced = (rows < sel.dense_blocks) | (col < sel.dense_blocks)
    if sel.keep_sink:
        forced |= col == 0
    if sel.keep_recent:
        forced |= col == n_cand - 1
    if sel.causal:
        forced |= n_cand <= 2
    return forced & cand


#: (shape, selection) already warned about: each warns once per process.
_WARNED_FORCED_ONLY: set[tuple[object, ...]] = set()


def _forced_only(
    budget: BlockBudget, q_blocks: int, kv_blocks: int, sel: BlockSelection, device: Any
) -> torch.Tensor:
    """The forced blocks, which alone take the budget; warns once per shape and
    selection when they are more than it."""
    key = (q_blocks, kv_blocks, sel.dense_blocks, sel.keep_ratio, sel.keep_sink)
    key += (sel.keep_recent, sel.causal)
    # Dynamo cannot trace a logging call (a graph break, an error under fullgraph): a
    # compiled call stays quiet and the first eager one warns.
    if budget.forced > budget.total and key not in _WARNED_FORCED_ONLY and not traced():
        _WARNED_FORCED_ONLY.add(key)
        logger.warning(
            "ditops block-sparse attention: the forced blocks (%d leading dense blocks, "
            "rows and columns: the first frame and what the model family keeps dense with "
            "it, such as text or history latents; sink, recent) are %.3f of the %dx%d block "
            "map, more than the density asked for (%.3f = 1 - sparsity); running the "
            "forced blocks only: density %.3f ran (sparsity %.3f), the smallest reachable "
            "at this shape (ditops.sparse_densities reads it per layer).",
            sel.dense_blocks,
            budget.min_density,
            q_blocks,
            kv_blocks,
            sel.keep_ratio,
            budget.min_density,
            1.0 - budget.min_density,
        )
    return forced_block_mask(q_blocks, kv_blocks, sel, device=device)


def mask_without_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    sel: BlockSelection | None = None,
    *,
    block_size: int,
    **fields: Any,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(mask, counts)`` when the in-budget selection needs no scores, else ``None``.

    That is when the forced blocks take the whole budget (they alone run; warns once),
    or when the budget is every candidate and no threshold can drop one. q/k as BNSD.
    """
    sel = selection_of(sel, fields)
    if not sel.in_budget or (sel.mass is not None and sel.mass < 1.0):
        return None
    q_blocks = num_blocks(int(q.shape[2]), block_size)
    kv_blocks = num_blocks(int(k.shape[2]), block_size)
    budget = block_budget(q_blocks, kv_blocks, sel)
    if sel.mass is not None:  # mass 1: every block (each holds some mass)
        keep = candidate_blocks(q_blocks, kv_blocks, causal=sel.causal, device=q.device)
    elif budget.forced_only:
        keep = _forced_only(budget, q_blocks, kv_blocks, sel, q.device)
    elif budget.total == budget.candidates and sel.threshold >= 1.0:
        keep = candidate_blocks(q_blocks, kv_blocks, causal=sel.causal, device=q.device)
    else:
        return None
    mask = keep.to(torch.int8).expand(int(q.shape[0]), int(q.shape[1]), -1, -1).contiguous()
    return mask, row_counts(mask)


def select_in_budget(
    scores: torch.Tensor,
    sel: BlockSelection | None = None,
    *,
    allocation: str = "row",
    **fields: Any,
) -> torch.Tensor:
    """Bool ``[..., Qb, KVb]`` of kept blocks, forced ones included (in-budget reading):
    the budget split over the rows (``allocation="row"``), spent over each head's map
    (``"head"``, :func:`ditops.attention.methods.select_per_head`) or over all the heads
    at once (``"layer"``, :func:`ditops.attention.methods.select_per_layer`)."""
    sel = selection_of(sel, fields)
    if sel.mass is not None:  # a mass target is not a budget: never ignore it silently
        raise ValueError(
            "select_in_budget: this selection asks for a mass target; select its blocks with "
            "ditops.attention.mass.select_by_mass"
        )
    q_blocks, kv_blocks = int(scores.shape[-2]), int(scores.shape[-1])
    dev = scores.device
    budget = block_budget(q_blocks, kv_blocks, sel)
    forced = forced_block_mask(q_blocks, kv_blocks, sel, device=dev)
    if budget.forced_only:
        return _forced_only(budget, q_blocks, kv_blocks, sel, dev).expand(scores.shape).clone()
    cand = candidate_blocks(q_blocks, kv_blocks, causal=sel.causal, device=dev)
    scored = cand & ~forced
    if allocation in POOLED_ALLOCATIONS:
        pick = select_per_head if allocation == "head" else select_per_layer
        return pick(scores, left=budget.total - budget.forced, forced=forced, scored=scored)
    # Scores are masses (>= 0): -1 ranks unscored blocks and NaN last, never kept.
    v = scores.masked_fill(~scored | scores.isnan(), -1.0)
    order = v.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(
        -1, order, torch.arange(kv_blocks, device=dev).expand_as(order)
    )
    limit = budget.row_shares(dev)[:, None]
    if sel.threshold < 1.0:
        ranked = v.gather(-1, order).clamp(min=0.0)
        reached = ranked.cumsum(-1) < sel.threshold * ranked.sum(-1, keepdim=True)
        limit = torch.minimum(limit, reached.sum(-1, keepdim=True) + 1)
    return (scored & (v >= 0) & (rank < limit)) | forced
