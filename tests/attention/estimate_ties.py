"""How close an estimate must be to native: score tolerances and the near-tie criterion.

Shared by the Triton estimate's tests and benchmarks/gpu/estimate.py (no pytest here).

Block scores: ``|got - want| <= rtol * want + atol`` (see :func:`rtol`). Masks: the
selection is the same code on both sides, so a mask may differ from native's only where
block scores within that tolerance select differently: a *near-tie*. A differing block
is a near-tie when, in native's scores, a block on the other side of the row's cut is
within twice the tolerance of it (a dropped block that may overtake a kept one, or a
kept block in a group tied at the cut), or, under a threshold, when it is next to the
cut in sorted order and the sorted cumulative sum passes ``threshold * total`` within
twice the tolerance of the total.
"""

from __future__ import annotations

import torch

from ditops.attention.block_mask import causal_candidates
from ditops.attention.estimate import select_blocks
from ditops.attention.selection import forced_block_mask, select_in_budget

#: Unit roundoff of the 16-bit input dtypes.
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
#: Absolute slack for near-zero scores (fp16 subnormal probabilities).
ATOL = 1e-6


def rtol(dtype: torch.dtype, passes: int) -> float:
    """Relative tolerance of Triton block scores against native (kernel docstring).

    ``passes=2`` repeats native's roundings; fp32 summation orders can move a rounded
    per-row sum by one ulp: ``2u``. ``passes=1`` rounds unnormalised probabilities
    (each per-row sum moves by at most ``u`` before both sides round once more): ``4u``.
    fp32 inputs: summation orders and ``exp`` implementations only: ``1e-5``.
    """
    if dtype == torch.float32:
        return 1e-5
    return (2 if passes == 2 else 4) * UNIT_ROUNDOFF[dtype]


def scored_blocks(q_blocks, kv_blocks, *, causal, keep_sink, keep_recent):
    """Bool [Qb, KVb]: candidates minus the always-kept sink and recent blocks."""
    if causal:
        cand = causal_candidates(q_blocks, kv_blocks)
    else:
        cand = torch.ones(q_blocks, kv_blocks, dtype=torch.bool)
    last = cand.sum(-1, keepdim=True) - 1
    col = torch.arange(kv_blocks)[None, :]
    forced = (col == last) if keep_recent else torch.zeros_like(cand)
    if keep_sink:
        forced = forced | ((col == 0) & cand)
    return cand & ~forced


def near_tie(v, j, kept, scored, tol, threshold) -> bool:
    """Whether flipping block ``j`` of a row with native scores ``v`` is a near-tie.

    ``kept``/``scored``: native's kept blocks and the scored ones (bool rows).
    """
    on, off = v[scored & kept], v[scored & ~kept]
    tau = 2 * (tol[0] * float(v[j]) + tol[1])
    if kept[j]:
        # A dropped block may overtake it, or it sits in a group tied at the cut.
        if off.numel() and float(v[j] - off.max()) <= tau:
            return True
        if float(v[j] - on.min()) <= tau and int(((on - v[j]).abs() <= tau).sum()) >= 2:
            return True
    elif on.numel() and float(on.min() - v[j]) <= tau:
        return True  # it may overtake the weakest kept block
    if threshold >= 1:
        return False
    # Threshold: the cut moves by one block when the sorted cumulative sum passes
    # threshold * total within the tolerance of the total.
    order = v[scored].sort(descending=True).values
    n_kept = int(on.numel())
    if float(v[j]) not in order[max(0, n_kept - 1) : n_kept + 1].tolist():
        return False
    total = float(order.sum())
    sums = order.cumsum(0)[max(0, n_kept - 2) : n_kept + 1]
    slack = 2 * (tol[0] * total + tol[1] * order.numel())
    return bool(((sums - threshold * total).abs() <= slack).any())


def near_tie_violations(
    mask,
    want_mask,
    scores,
    tol,
    *,
    threshold,
    keep_ratio,
    causal,
    keep_sink,
    keep_recent,
    dense_blocks=0,
    forced_blocks="in_budget",
    max_rows=None,
    **_,
):
    """Blocks where ``mask`` differs from ``want_mask`` that are not near-ties (see top).

    ``scores`` are native's; what native's selection keeps is recomputed from them, as
    the first-frame forcing hides it in ``want_mask`` (sglang's reading). In ditops'
    reading (``forced_blocks="in_budget"``) the first frame's blocks are not scored
    either, and each row keeps a fixed number of blocks by rank: a tie at the cut then
    swaps one block for another. ``max_rows``: check only the first that many
    differing rows (the loop runs in Python).
    """
    q_blocks, kv_blocks = scores.shape[-2:]
    flags = {"keep_sink": keep_sink, "keep_recent": keep_recent, "causal": causal}
    if forced_blocks == "in_budget":
        cand = causal_candidates(q_blocks, kv_blocks) if causal else True
        forced = forced_block_mask(q_blocks, kv_blocks, dense_blocks=dense_blocks, **flags)
        scored = cand & ~forced
        selected = select_in_budget(
            scores,
            threshold=threshold,
            keep_ratio=keep_ratio,
            dense_blocks=dense_blocks,
            **flags,
        )
    else:
        scored = scored_blocks(q_blocks, kv_blocks, **flags)
        selected = select_blocks(scores, threshold=threshold, keep_ratio=keep_ratio, **flags)
    bad = []
    for b, h, r in (mask != want_mask).any(-1).nonzero()[:max_rows].tolist():
        v, kept = scores[b, h, r], selected[b, h, r]
        # Causal rows of at most two candidates keep them all: nothing is scored.
        sc = scored[r] if not causal or r + 1 > 2 else torch.zeros_like(scored[r])
        for j in (mask[b, h, r] != want_mask[b, h, r]).nonzero().flatten().tolist():
            if not sc[j]:
                bad.append((b, h, r, j, "not a scored block"))
            elif not near_tie(v, j, kept, sc, tol, threshold):
                bad.append((b, h, r, j, float(v[j])))
    return bad
