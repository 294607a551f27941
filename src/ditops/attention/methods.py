"""The estimator's methods: how block scores are computed and how the budget is spent.

A method is a pair (scores, allocation), named in :data:`METHODS`:

* **scores** ``"antidiagonal"``: XAttention's strided antidiagonal scores
  (:func:`ditops.attention.estimate.block_scores`; what the Triton and NPU kernels
  compute). ``"sampled"``: ``samples`` query rows of each query block, spread evenly
  over it, attend to *every* key exactly (one softmax per sampled row), and a block's
  score is the mass its sampled rows give each key block (:func:`sampled_block_scores`).
  That is the exact block mass the oracles rank by, estimated from a sample of the
  block's queries: neighbouring queries of a video attend alike, so a few rows suffice.
  Its work is ``samples / block_size`` of a dense attention's (4 rows: 1/32), run as an
  attention by SDPA (one call per ``D`` key blocks); the antidiagonal's is
  ``1 / stride`` of a dense ``q k^T`` (stride 8: 1/8) plus a softmax over
  ``(Sq / stride) x (Skv / stride)``.
* **allocation** ``"row"``: the budget left after the forced blocks is split over the
  rows in proportion to their scored candidates, each row keeping its best blocks
  (:func:`ditops.attention.estimate.select_in_budget`). ``"head"``: the same budget per
  head, spent on the blocks that add the most of their row's estimated mass over the
  whole map (:func:`select_per_head`): diffuse rows get more blocks, sharp rows fewer,
  the total per head unchanged (only the in-budget reading: ``forced_blocks="on_top"``
  caps each row by definition). ``"layer"``: the same over all the heads of the call
  at once (:func:`select_per_layer`): heads with diffuse attention get more blocks,
  sharp heads fewer, the total over the heads unchanged (the density asked is the
  layer's; one head's may differ). Not under context parallelism, where each rank holds
  some of the heads (refused there), nor on the NPU kernel (per row only).

Measured on :mod:`ditops.bench.video_attention` (``ditops bench masks``): see
``docs/sparse-attention.md``, benchmarks/README.md and ``benchmarks/cpu/masks.txt``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ditops.attention.block_mask import num_blocks
from ditops.attention.layout import plan_chunks
from ditops.core.checks import as_int

#: method name -> (scores, allocation).
METHODS: dict[str, tuple[str, str]] = {
    "sampled": ("sampled", "row"),
    "sampled_head": ("sampled", "head"),
    "antidiagonal": ("antidiagonal", "row"),
    "antidiagonal_head": ("antidiagonal", "head"),
    "sampled_layer": ("sampled", "layer"),
}
#: Allocations that spend one budget over many rows (the in-budget reading only).
POOLED_ALLOCATIONS = ("head", "layer")
#: The op's default (its documented XAttention meaning) and the layer's default.
OP_DEFAULT_METHOD = "antidiagonal"
DEFAULT_METHOD = "sampled"
#: Query rows per block the sampled scores read by default.
DEFAULT_SAMPLES = 4
#: fp32 scores :func:`sampled_block_scores_fp32` holds at once (8 MiB: one head's 256
#: sampled rows at 8k keys); two heads at once ran 1.4x slower on a 2-core EPYC.
FP32_CHUNK_ELEMENTS = 1 << 21


def check_method(
    method: object, samples: object, *, forced_blocks: str, threshold: float, where: str
) -> None:
    """Raise a ValueError saying what is valid when ``method``/``samples`` are not."""
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"{where}: method must be one of {tuple(METHODS)}, got {method!r}")
    number = as_int(samples)
    if number is None or number < 1:
        raise ValueError(f"{where}: samples must be an int >= 1, got {samples!r}")
    if METHODS[method][1] in POOLED_ALLOCATIONS:
        over = "per head" if METHODS[method][1] == "head" else "over a layer's heads"
        if forced_blocks != "in_budget":
            raise ValueError(
                f"{where}: method {method!r} spends one budget {over}; it needs "
                f"forced_blocks='in_budget' (got {forced_blocks!r}, a per-row cap)"
            )
        if threshold < 1.0:
            raise ValueError(
                f"{where}: method {method!r} spends the whole budget {over}; threshold "
                f"< 1 (got {threshold}) applies to the per-row methods only"
            )


def sample_rows(q_len: int, block_size: int, samples: int) -> torch.Tensor:
    """Query positions sampled: ``samples`` per block at the centres of equal slices of
    its real rows (a partial last block samples within its rows; repeats are allowed)."""
    starts = torch.arange(num_blocks(q_len, block_size)) * block_size
    real = (q_len - starts).clamp(max=block_size)
    centre = (torch.arange(samples, dtype=torch.float64) + 0.5) / samples
    return (starts[:, None] + (centre[None, :] * real[:, None]).long()).reshape(-1)


def sampled_block_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    block_size: int,
    samples: int,
    scale: float,
    causal: bool,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """fp32 ``[B, Nq, Qb, KVb]``: per query block, the softmax mass its ``samples``
    sampled rows give each key block (each row's mass sums to 1; BNSD inputs, GQA).

    Computed as attention: the sampled rows attend to every key with, as values, the
    one-hot key-block indicator, so the output row *is* the mass per key block (SDPA:
    its flash kernels run it at their speed per score: on GPUs, and on CPUs with AMX,
    where it was measured faster than matmul + exp + sums; without AMX the estimate's
    CPU path runs :func:`sampled_block_scores_fp32` instead. The one-hot values go ``D``
    columns per call, padded to ``D`` so the flash kernel serves them, and on CPU are
    not copied per head). In
    ``compute_dtype`` (default q's); bf16/fp16 outputs round each mass to the dtype.
    Under ``causal`` a query block's candidates are the key blocks up to its own (block
    level, as the selection's).
    """
    batch, heads, q_len, dim = (int(s) for s in q.shape)
    kv_heads, kv_len = int(k.shape[1]), int(k.shape[2])
    dtype = q.dtype if compute_dtype is None else compute_dtype
    q_blocks, kv_blocks = num_blocks(q_len, block_size), num_blocks(kv_len, block_size)
    rows = sample_rows(q_len, block_size, samples).to(q.device)
    qs, kk = q.index_select(2, rows).to(dtype), k.to(dtype)
    col_block = torch.arange(kv_len, device=q.device) // block_size
    mask = None
    if causal:
        mask = col_block[None, :] <= (rows // block_size)[:, None]
    out = torch.empty(batch, heads, q_blocks, kv_blocks, dtype=torch.float32, device=q.device)
    for c0 in range(0, kv_blocks, dim):
        c1 = min(kv_blocks, c0 + dim)
        onehot = (col_block[:, None] == torch.arange(c0, c0 + dim, device=q.device)).to(dtype)
        v = onehot.expand(batch, kv_heads, kv_len, dim)
        if q.device.type != "cpu":  # ATen's CPU flash kernel reads stride-0 heads; others untested
            v = v.contiguous()
        mass = F.scaled_dot_product_attention(
            qs, kk, v, attn_mask=mask, scale=scale, enable_gqa=heads != kv_heads
        )
        mass = mass[..., : c1 - c0].float().reshape(batch, heads, q_blocks, samples, c1 - c0)
        out[..., c0:c1] = mass.sum(3)
    return out


def sampled_block_scores_fp32(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    block_size: int,
    samples: int,
    scale: float,
    causal: bool,
) -> torch.Tensor:
    """:func:`sampled_block_scores` computed in fp32 as a matmul and a softmax, one head
    and a chunk of its sampled rows at a time (at most :data:`FP32_CHUNK_ELEMENTS`
    scores): the mass each block's sampled rows give each key block, exact to fp32
    rounding whatever q's dtype (no rounding of scores or masses to it).

    The estimate's CPU path (:mod:`ditops.ops.estimate_block_mask`) on CPUs without
    AMX. On a 2-core AVX-512 EPYC at [1, 12, 8192, 128] bf16 and 4 samples
    (``benchmarks/cpu/probes/permute_cost.txt``) it took 0.62-0.67x the time of the
    flash-kernel form on one thread (the flash kernel splits 256 query rows into
    64-row tiles of bf16 work without AMX, and multiplies the one-hot values too), and
    0.71x on two threads with the cores to themselves; with another process on a
    core, two threads ran it slower than the flash kernel (its many short parallel
    regions wait for a descheduled thread; the flash kernel is one).
    """
    batch, heads, q_len, _ = (int(s) for s in q.shape)
    kv_heads, kv_len = int(k.shape[1]), int(k.shape[2])
    group = heads // kv_heads
    q_blocks, kv_blocks = num_blocks(q_len, block_size), num_blocks(kv_len, block_size)
    qs, allowed = sampled_rows_fp32(
        q, kv_len, block_size=block_size, samples=samples, scale=scale, causal=causal
    )
    n_rows, full = int(qs.shape[2]), kv_len // block_size
    out = torch.empty(batch, heads, q_blocks, kv_blocks, dtype=torch.float32, device=q.device)
    # One head at a time, 2-D matmuls: ATen splits a batched matmul of a batch of one
    # over its batch, one thread. Scores and probabilities go to two buffers made once
    # (fresh 8 MiB tensors per head cost their page faults: 0.9x the time without them).
    _, row_chunk = plan_chunks(1, n_rows, kv_len, samples, FP32_CHUNK_ELEMENTS)
    buffers = torch.empty(2, min(row_chunk, n_rows), kv_len, device=q.device)
    for b in range(batch):
        kt = None
        for h in range(heads):
            if h % group == 0:  # each key head converted once, for its group of query heads
                kt = k[b, h // group].float().T  # [D, Skv]
            for r0 in range(0, n_rows, row_chunk):
                r1 = min(n_rows, r0 + row_chunk)
                scores, probs = buffers[0, : r1 - r0], buffers[1, : r1 - r0]
                torch.mm(qs[b, h, r0:r1], kt, out=scores)
                torch.softmax(_masked(scores, allowed, r0, r1), -1, out=probs)
                mass = probs[:, : full * block_size].unflatten(-1, (full, block_size)).sum(-1)
                if full < kv_blocks:  # a partial last key block
                    rest = probs[:, full * block_size :].sum(-1, keepdim=True)
                    mass = torch.cat([mass, rest], -1)
                blocks = mass.unflatten(0, ((r1 - r0) // samples, samples)).sum(1)
                out[b, h, r0 // samples : r1 // samples] = blocks
    return out


def sampled_rows_fp32(
    q: torch.Tensor, kv_len: int, *, block_size: int, samples: int, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The sampled query rows in fp32 times ``scale`` (``[B, N, R, D]``: the scale applied
    in fp32, once) and, under ``causal``, bool ``[R, Skv]`` of the keys each may see."""
    rows = sample_rows(int(q.shape[2]), block_size, samples).to(q.device)
    allowed = None
    if causal:
        col_block = torch.arange(kv_len, device=q.device) // block_size
        allowed = col_block[None, :] <= (rows // block_size)[:, None]
    return q.index_select(2, rows).float() * scale, allowed


def _masked(scores: torch.Tensor, allowed: torch.Tensor | None, r0: int, r1: int) -> torch.Tensor:
    return scores if allowed is None else scores.masked_fill_(~allowed[r0:r1], float("-inf"))


def select_per_head(
    scores: torch.Tensor, *, left: int, forced: torch.Tensor, scored: torch.Tensor
) -> torch.Tensor:
    """Bool ``[..., Qb, KVb]``: the ``left`` scored blocks per head that add the most of
    their row's estimated mass (each row's scores normalised to its total, forced blocks
    included), plus ``forced``.

    Within a row the gains fall with rank, so this is the best split of ``left`` blocks
    over the rows for the estimated mass (the per-head oracle's, on estimated scores).
    Ties: the earlier row, then the lower key block. NaN scores are never kept (a head
    with NaN may then keep fewer).
    """
    total = scores.nan_to_num(0.0).sum(-1, keepdim=True)
    share = scores / total.clamp(min=torch.finfo(torch.float32).tiny)
    v = share.masked_fill(~scored | share.isnan(), -1.0).flatten(-2)
    order = v.argsort(dim=-1, descending=True, stable=True)[..., :left]
    keep = torch.zeros_like(v, dtype=torch.bool).scatter_(-1, order, True)
    keep &= v >= 0
    return keep.view(scores.shape) | forced


def select_per_layer(
    scores: torch.Tensor, *, left: int, forced: torch.Tensor, scored: torch.Tensor
) -> torch.Tensor:
    """Bool ``[B, N, Qb, KVb]``: :func:`select_per_head` over all ``N`` heads of each batch
    entry at once, ``left`` scored blocks per head on average (``N * left`` in all).

    Every row's scores are normalised to its own total first, so a block's gain is the
    share of its row's mass it adds, comparable across heads: the greedy choice keeps
    the most estimated mass over the layer. Ties: the earlier head, row, key block.
    """
    b, n, qb, kvb = (int(x) for x in scores.shape)
    keep = select_per_head(
        scores.reshape(b, 1, n * qb, kvb),
        left=n * left,
        forced=forced.repeat(n, 1),
        scored=scored.repeat(n, 1),
    )
    return keep.view(b, n, qb, kvb)
