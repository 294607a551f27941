"""Mass targets: the fewest blocks covering a share of the estimated attention mass.

``BlockSparseConfig(mass=...)`` / ``estimate_block_mask(..., mass=...)`` select with
:func:`select_by_mass` instead of a density budget
(:func:`ditops.attention.selection.select_in_budget`); the density is whatever the scores
need, and what runs is what is reported.
"""

from __future__ import annotations

from typing import Any

import torch

from ditops.attention.selection import (
    BlockSelection,
    candidate_blocks,
    forced_block_mask,
    selection_of,
)


def select_by_mass(
    scores: torch.Tensor,
    sel: BlockSelection | None = None,
    *,
    allocation: str = "row",
    **fields: Any,
) -> torch.Tensor:
    """Bool ``[..., Qb, KVb]``: the fewest blocks covering ``sel.mass`` of the estimated
    mass, forced blocks included (and counted as covered).

    ``allocation="row"``: every query block row keeps its forced blocks, then its scored
    blocks in descending score (the lower key block first on ties) until the kept ones
    hold ``mass`` of the row's total over its candidates. ``"head"``: each row's scores
    normalised to its total, a head keeps the blocks adding the most of their row's mass
    over its whole map until the mean over its rows (rows with some mass) reaches
    ``mass``: diffuse rows get more blocks, sharp rows fewer. Either way the density is
    whatever the scores need, per row or per head (what runs is the mask returned:
    ``density_stats`` of it is the density). Sums in fp64, so the coverage computed from
    the returned mask is never below ``mass`` by more than fp64 rounding. NaN scores
    count as no mass and are never kept.
    """
    sel = selection_of(sel, fields)
    assert sel.mass is not None
    q_blocks, kv_blocks = int(scores.shape[-2]), int(scores.shape[-1])
    dev = scores.device
    forced = forced_block_mask(q_blocks, kv_blocks, sel, device=dev)
    cand = candidate_blocks(q_blocks, kv_blocks, causal=sel.causal, device=dev)
    scored = cand & ~forced
    nan = scores.isnan()
    mass = (scores.double() * cand).masked_fill(nan | ~cand, 0.0).clamp(min=0.0)
    total = mass.sum(-1, keepdim=True)
    if allocation == "row":
        gain, covered = mass, (mass * forced).sum(-1, keepdim=True)
        target = sel.mass * total
        flat = False
    else:  # "head": shares of each row's mass, over the head's whole map
        gain = mass / total.clamp(min=torch.finfo(torch.float64).tiny)
        live = (total > 0).double()
        covered = (gain * forced).sum((-2, -1)).reshape(*gain.shape[:-2], 1)
        target = sel.mass * live.sum((-2, -1)).reshape(*gain.shape[:-2], 1)
        flat = True
    v = gain.masked_fill(~scored | nan, -1.0)  # unscored and NaN ranked last, never kept
    if flat:
        v = v.flatten(-2)
    order = v.argsort(dim=-1, descending=True, stable=True)
    ranked = v.gather(-1, order)
    before = ranked.clamp(min=0.0).cumsum(-1) - ranked.clamp(min=0.0)  # mass kept before
    keep_sorted = (covered + before < target) & (ranked >= 0)
    keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
    return keep.view(scores.shape) | forced


def covered_mass(
    q: torch.Tensor,
    k: torch.Tensor,
    mask: torch.Tensor,
    *,
    block_size: int,
    scale: float | None = None,
) -> torch.Tensor:
    """fp32 ``[B, H]``: the share of the exact softmax mass a block mask keeps, averaged
    over each head's query rows. A diagnostic: what a mass target covered in truth.

    A mass target (``mass=``) is met on the *estimate's* scores (sampled rows, or
    antidiagonals), which see a row's mass only in part, so the target is the
    estimate's: on the bench's video-like q/k, ``mass=0.95`` covered 0.88-0.99 of each
    head's mass in truth with ``"sampled"`` (0.86-0.95 with ``"sampled_head"``); with
    every row sampled (``samples=block_size``) it is met. This measures it on your q/k:
    it computes the dense attention's probabilities (fp32, a slice of rows at a time),
    so it costs about a dense attention. ``q``/``k`` BNSD, ``k`` with ``q``'s heads or fewer (GQA);
    ``mask`` ``[B, H, Qb, KVb]`` as the estimate returns it.
    """
    batch, heads, q_len, dim = (int(s) for s in q.shape)
    kv_len, group = int(k.shape[2]), heads // int(k.shape[1])
    scale = dim**-0.5 if scale is None else scale
    col = torch.arange(kv_len, device=q.device) // block_size
    rows_per = max(block_size, (1 << 22) // max(kv_len, 1) // block_size * block_size)
    out = torch.zeros(batch, heads, dtype=torch.float32, device=q.device)
    for b in range(batch):
        for h in range(heads):
            kf = k[b, h // group].float()
            kept = 0.0
            for r0 in range(0, q_len, rows_per):
                r1 = min(q_len, r0 + rows_per)
                p = torch.softmax(q[b, h, r0:r1].float() @ kf.T * scale, dim=-1)
                rows = mask[b, h, torch.arange(r0, r1, device=q.device) // block_size]
                kept += float((p * rows[:, col].to(p.dtype)).sum())
            out[b, h] = kept / max(q_len, 1)
    return out
