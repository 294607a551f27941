"""Estimating a block mask from queries and keys: XAttention-style antidiagonal scoring.

This is the meaning of the ``estimate_block_mask`` op (its ``forward_native``), written
from the contract of the NPU operator ``attentions.sparse_block_estimate``
(``docs/npu.md``, "The kernels' contract"), in plain PyTorch:

1. **Strided antidiagonal scores.** Positions are grouped ``stride`` at a time. Keys are
   reversed inside each group, so one matmul of the ``[S / stride, stride * D]`` views
   sums the dot products along an antidiagonal of every ``stride x stride`` cell.
   (The NPU reverses the queries instead; it is the same sum.) Sequence lengths that
   are not multiples of ``stride`` are padded with zeros, which add nothing to a dot
   product; a strided key column exists only where it holds at least one real key, so
   padding never counts as a key.
2. Scores times ``scale / stride`` (``scale`` is the attention's softmax scale) are
   softmax-normalised per strided query row, over the candidate key blocks.
3. Probabilities are summed into ``block_size / stride``-sized cells: one score per
   (query block, key block); each query block's row holds the softmax mass its
   strided rows give each key block.
4. Per row, over the *scored* candidates (the candidates minus sink and recent blocks,
   which are always kept and take no part in scoring): sort descending and accumulate
   until the sum reaches ``threshold`` times the row's scored total; that score is the
   cut-off (``threshold >= 1`` keeps every scored block). Then the top-k cap: when more
   than ``keep_ratio * candidates`` blocks were selected and the row has at least 10
   candidates, the cut-off becomes the ``int(candidates * keep_ratio)``-th largest
   score. Scored blocks above ``cut-off - 1e-5`` are kept (ties kept).
5. ``keep_sink`` keeps key block 0; ``keep_recent`` keeps the last candidate block (the
   diagonal one under ``causal``, else the last key block).
6. ``causal``: only key blocks up to the diagonal (top-left aligned) are candidates; a
   row with at most two candidates keeps them all.
7. GQA: query head ``n`` reads key head ``n // (Nq / Nkv)``.

Then ``dense_blocks`` (the first video frame, see :mod:`ditops.attention.schedule`)
forces the first ``F`` block rows and columns on, and counts are recomputed as row sums.

Steps 4-6 as written are sglang's reading of ``keep_ratio`` (``forced_blocks="on_top"``):
a per-row cap on the scored blocks, with sink, recent and first-frame blocks kept on
top, so the density that runs is above ``keep_ratio``. ditops' default reading
(``forced_blocks="in_budget"``) makes ``keep_ratio`` the share of the whole block map
that runs, forced blocks included:

* **Forced blocks** are the first ``F`` block rows and columns (causal candidates only),
  sink and recent blocks, and, under ``causal``, rows of at most two candidates. They
  take no part in scoring.
* **The budget** is ``round(keep_ratio * candidates)`` blocks per head (``candidates``:
  the blocks of the map, the causal triangle's under ``causal``). The forced blocks are
  paid first; what is left is split over the query block rows in proportion to their
  scored candidates (largest remainders get one more, earlier rows first on ties).
  Every head gets the same split, so realised density equals ``keep_ratio`` to within
  one block (:func:`block_budget`).
* Each row keeps its share of scored blocks by rank (descending score, the lower key
  block first on ties: counts are exact); under ``threshold < 1`` a row keeps fewer when
  its scored mass reaches ``threshold`` sooner (the threshold as in step 4). NaN scores
  are never kept.
* When the forced blocks alone are the budget or more, only they run (no scores are
  computed); when they are more, the first such call per shape and density warns on the
  ``ditops`` logger, naming the smallest density reachable.

Why per row and not over each head's whole map (one top-k for all its rows): measured
on video-like inputs at Wan's shape (``benchmarks/cpu/probes/budget_per_row_vs_map.py``,
8064 tokens, 12 heads, first frame 3 blocks), the whole-map split keeps a little more of
the softmax mass (0.917 vs 0.909 at density 0.5, 0.676 vs 0.674 at 0.25) and its output
error against dense attention is lower at density 0.5 (relative L2 0.090 vs 0.101) but
higher at 0.25 and 0.15 (0.452 vs 0.444, 1.34 vs 1.25), with the worst query blocks
twice as wrong (their error 4.1 vs 2.0 at 0.25): rows whose attention is spread out lose
the competition and starve. Per-row splits also keep every row's work equal, and a
per-row kernel (the NPU's) can follow them.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from ditops.attention.block_mask import causal_candidates, num_blocks, row_counts
from ditops.attention.layout import plan_chunks, to_bnsd
from ditops.attention.mass import select_by_mass
from ditops.attention.methods import sampled_block_scores
from ditops.attention.selection import (
    BlockSelection,
    candidate_blocks,
    mask_without_scores,
    select_in_budget,
    selection_of,
)

#: The top-k cap applies only to rows with at least this many candidate blocks.
MIN_CANDIDATES_FOR_CAP = 10
#: Kept: scored blocks above cut-off minus this (so ties at the cut-off are kept).
CUTOFF_EPS = 1e-5


def estimate_block_mask_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    sel: BlockSelection | None = None,
    *,
    layout: str = "BNSD",
    block_size: int = 128,
    stride: int = 8,
    scale: float | None = None,
    **fields: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Estimate a block mask (see the module docstring for the algorithm).

    Args:
        q: queries ``[B, Nq, Sq, D]`` (``BNSD``) or ``[B, Sq, Nq, D]`` (``BSND``).
        k: keys, same layout, ``Nkv`` heads dividing ``Nq``.
        sel: the selection (:class:`ditops.attention.selection.BlockSelection`: threshold,
            keep_ratio and its reading, sink/recent/causal, first-frame blocks, method);
            or give its fields as keyword arguments.
        scale: the attention softmax scale (default ``D ** -0.5``); scores use
            ``scale / stride``.

    Returns:
        ``(mask, counts)``: int8 ``[B, Nq, Qb, KVb]`` and int32 ``[B, Nq, Qb]``.

    Arguments are checked by the op (:data:`ditops.ops.estimate_block_mask.estimate_block_mask`).
    """
    sel = selection_of(sel, fields)
    qb_, kb_ = to_bnsd(q, layout), to_bnsd(k, layout)
    if qb_.shape[2] == 0 or kb_.shape[2] == 0:
        q_blocks = num_blocks(int(qb_.shape[2]), block_size)
        kv_blocks = num_blocks(int(kb_.shape[2]), block_size)
        mask = torch.zeros(*qb_.shape[:2], q_blocks, kv_blocks, dtype=torch.int8, device=q.device)
        return mask, row_counts(mask)
    without = mask_without_scores(qb_, kb_, sel, block_size=block_size)
    if without is not None:
        return without
    if scale is None:
        scale = int(qb_.shape[-1]) ** -0.5
    if sel.scoring == "sampled":
        scores = sampled_block_scores(
            qb_, kb_, block_size=block_size, samples=sel.samples, scale=scale, causal=sel.causal
        )
    else:
        scores = block_scores(
            qb_,
            kb_,
            block_size=block_size,
            stride=stride,
            score_scale=scale / stride,
            causal=sel.causal,
        )
    return mask_from_scores(scores, sel)


def mask_from_scores(
    scores: torch.Tensor,
    sel: BlockSelection | None = None,
    *,
    allocation: str | None = None,
    **fields: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 4-6 and the first frame: ``(mask, counts)`` from fp32 block scores.

    Every path that computes the block scores itself (the Triton estimate) finishes
    here, so the selection has one definition. ``allocation``: ``"row"``, ``"head"`` or
    ``"layer"`` (:mod:`ditops.attention.methods`; the last two in-budget only);
    default: the selection's method's.
    """
    sel = selection_of(sel, fields)
    if sel.in_budget:
        how = allocation or sel.allocation
        if sel.mass is not None:
            keep = select_by_mass(scores, sel, allocation=how)
        else:
            keep = select_in_budget(scores, sel, allocation=how)
        mask = keep.to(torch.int8)
        return mask, row_counts(mask)
    keep = select_blocks(
        scores,
        threshold=sel.threshold,
        keep_ratio=sel.keep_ratio,
        keep_sink=sel.keep_sink,
        keep_recent=sel.keep_recent,
        causal=sel.causal,
    )
    mask = force_dense_blocks(keep, sel.dense_blocks, causal=sel.causal)
    return mask, row_counts(mask)


def block_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    block_size: int,
    stride: int,
    score_scale: float,
    causal: bool,
) -> torch.Tensor:
    """Steps 1-3: fp32 ``[B, Nq, Qb, KVb]`` softmax mass per block pair (BNSD inputs)."""
    batch, heads, q_len, dim = (int(s) for s in q.shape)
    kv_heads, kv_len = int(k.shape[1]), int(k.shape[2])
    group = heads // kv_heads
    cells = block_size // stride
    q_blocks, kv_blocks = num_blocks(q_len, block_size), num_blocks(kv_len, block_size)
    q_rows, k_cols = math.ceil(q_len / stride), math.ceil(kv_len / stride)
    # Zero-pad to whole strided groups; a zero adds nothing to a dot product.
    qp = F.pad(q, (0, 0, 0, q_rows * stride - q_len)) if q_len % stride else q
    kp = F.pad(k, (0, 0, 0, k_cols * stride - kv_len)) if kv_len % stride else k
    q_str = qp.reshape(batch, heads, q_rows, stride * dim)
    # Reversing keys inside each group puts the antidiagonal on the matmul's diagonal.
    k_str = kp.reshape(batch, kv_heads, k_cols, stride, dim).flip(3)
    k_str = k_str.reshape(batch, kv_heads, k_cols, stride * dim)

    allowed = None
    if causal:
        # Block-level causal candidates at strided resolution.
        row_block = torch.arange(q_rows, device=q.device) // cells
        col_block = torch.arange(k_cols, device=q.device) // cells
        allowed = col_block[None, :] <= row_block[:, None]

    # 0/1 [strided column, key block]: a matmul sums each row's probabilities per key block
    # (a partial last block simply has fewer columns).
    cols = torch.arange(k_cols, device=q.device)
    pool = (cols[:, None] // cells == torch.arange(kv_blocks, device=q.device)[None, :]).to(q.dtype)
    out = torch.zeros(batch, heads, q_blocks, kv_blocks, dtype=torch.float32, device=q.device)
    head_chunk, row_chunk = plan_chunks(heads, q_rows, k_cols, cells)
    for b in range(batch):
        for h0 in range(0, heads, head_chunk):
            h1 = min(heads, h0 + head_chunk)
            if group == 1:
                kt = k_str[b, h0:h1]
            else:
                kt = k_str[b, torch.arange(h0, h1, device=q.device) // group]
            kt = kt.transpose(-1, -2)
            for r0 in range(0, q_rows, row_chunk):
                r1 = min(q_rows, r0 + row_chunk)
                # The scale goes into q (computed in fp32, rounded once to q's dtype), so
                # the matmul's output is the scaled score; softmax (fp32 inside) rounds
                # the probabilities to the dtype.
                qc = q_str[b, h0:h1, r0:r1] * score_scale
                s = torch.matmul(qc, kt)
                if allowed is not None:
                    s.masked_fill_(~allowed[r0:r1], float("-inf"))
                probs = torch.softmax(s, dim=-1)
                # Mass per (strided row, key block); then strided rows into query blocks.
                per_row = torch.matmul(probs, pool).float()
                row_block = torch.arange(r0, r1, device=q.device) // cells
                out[b, h0:h1].index_add_(1, row_block, per_row)
    return out


def select_blocks(
    scores: torch.Tensor,
    *,
    threshold: float,
    keep_ratio: float,
    keep_sink: bool,
    keep_recent: bool,
    causal: bool,
) -> torch.Tensor:
    """Steps 4-6: bool ``[..., Qb, KVb]`` of kept blocks from fp32 block scores."""
    q_blocks, kv_blocks = int(scores.shape[-2]), int(scores.shape[-1])
    dev = scores.device
    cand = candidate_blocks(q_blocks, kv_blocks, causal=causal, device=dev)
    n_cand = cand.sum(-1, keepdim=True)  # candidates are a prefix 0..n_cand-1 of each row
    col = torch.arange(kv_blocks, device=dev)[None, :]
    forced = torch.zeros_like(cand)
    if keep_sink:
        forced |= (col == 0) & cand
    if keep_recent:
        forced |= col == n_cand - 1
    scored = cand & ~forced
    v = scores.masked_fill(~scored, 0.0)
    ranked = v.sort(dim=-1, descending=True).values
    n_scored = scored.sum(-1, keepdim=True).expand(*v.shape[:-1], 1)
    n_forced = forced.sum(-1, keepdim=True)
    if threshold >= 1.0:
        cutoff = torch.zeros_like(v[..., :1])
        n_selected = n_cand.expand(*v.shape[:-1], 1)
    else:
        total = v.sum(-1, keepdim=True)
        reached = ranked.cumsum(-1) < threshold * total
        idx = torch.minimum(reached.sum(-1, keepdim=True), (n_scored - 1).clamp(min=0))
        cutoff = ranked.gather(-1, idx)
        n_selected = idx + 1 + n_forced
    # The cap keeps int(candidates * keep_ratio) scored blocks, computed in fp32 as the NPU does.
    ratio = torch.tensor(keep_ratio, dtype=torch.float32, device=dev)
    top_k = torch.floor(n_cand.to(torch.float32) * ratio).to(torch.int64).clamp(1, kv_blocks)
    capped = (n_selected.to(torch.float32) > n_cand.to(torch.float32) * ratio) & (
        n_cand >= MIN_CANDIDATES_FOR_CAP
    )
    cap_value = ranked.gather(-1, (top_k - 1).expand(*v.shape[:-1], 1))
    cutoff = torch.where(capped, cap_value, cutoff)
    keep = (scored & (v > cutoff - CUTOFF_EPS)) | forced
    if causal:
        keep = torch.where(n_cand <= 2, cand, keep)
    return keep


def force_dense_blocks(mask: torch.Tensor, dense_blocks: int, *, causal: bool) -> torch.Tensor:
    """Keep the first ``dense_blocks`` block rows and columns (the first video frame).

    ``mask`` is ``[..., Qb, KVb]`` (no padding columns). Under ``causal`` only causal
    candidates are forced. Returns a new int8 mask (the input is not modified).
    """
    out = mask.to(torch.int8)
    if dense_blocks <= 0:
        return out
    q_blocks, kv_blocks = int(mask.shape[-2]), int(mask.shape[-1])
    rows = torch.arange(q_blocks, device=mask.device)[:, None] < dense_blocks
    cols = torch.arange(kv_blocks, device=mask.device)[None, :] < dense_blocks
    force = rows | cols
    if causal:
        force &= causal_candidates(q_blocks, kv_blocks, mask.device)
    return out.masked_fill(force, 1)
