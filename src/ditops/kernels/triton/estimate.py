"""Block scores of the block-mask estimate on GPUs (cuda, hip, xpu), in one Triton kernel.

:func:`block_scores` computes steps 1-3 of :mod:`ditops.attention.estimate` (what its
``block_scores`` computes): strided antidiagonal scores, a softmax per strided query row,
and the probabilities summed per (query block, key block). The selection that follows is
the shared :func:`ditops.attention.estimate.mask_from_scores`. The strided score matrix
never goes to memory: a program holds ``BLOCK_M`` strided query rows (whole query blocks)
and walks the key tiles (whole key blocks), keeping only per-row statistics.

Design
    Program = (row tile, batch x query head); query head ``n`` reads key head
    ``n // group``. Per key tile of ``BLOCK_N`` strided columns, the scores are a GEMM of
    ``stride * ceil(D / BLOCK_D)`` chunks: chunk ``(j, d)`` multiplies the queries at
    offset ``j`` of each strided group by the keys at offset ``stride - 1 - j`` (that is
    the antidiagonal), so the strided views are never built. Tokens past a sequence load
    as zeros (nothing added to a dot product); columns past the last real key and causal
    non-candidates are -inf. A softmax needs its row's max and sum before any probability
    is final; two schedules (``passes``):

    * 2: pass 1 keeps the running max ``m`` and sum ``l``; pass 2 recomputes the scores
      and rounds each ``exp(s - m) / l`` to the input dtype, as the reference does.
    * 1 (default): online softmax. Each tile's ``exp(s - m_tile)`` (``m_tile`` the running
      max) are summed per key block and stored in fp32 with ``m_tile``; a last loop over
      the program's own rows rescales them by ``exp(m_tile - m) / l``. The workspace is
      ``[rows, key blocks]``, ``block_size / stride`` times smaller than the score matrix
      (bounded by launching at most :data:`WORKSPACE_BYTES` worth of heads at a time).

    Sums per key block are a matmul with a 0/1 pooling matrix (tensor cores, as the
    reference does); sums over the rows of a query block are a reshape-sum in fp32.

Numerics (against ``ditops.attention.estimate.block_scores``)
    Like the reference: ``q * scale / stride`` is rounded to the input dtype (done on the
    host with the reference's own expression), the score GEMM accumulates in fp32 and is
    rounded once to the dtype, softmax statistics are fp32, each row's per-key-block sum
    is rounded to the dtype, and rows are summed in fp32. fp32 inputs use IEEE fp32
    dots (no TF32). Differences: summation orders (fp32 level, which can move a rounded
    score by one ulp of the dtype), ``exp`` implementations, and with ``passes=1`` the
    rounding of probabilities to the dtype before normalisation instead of after (each
    per-row block sum then differs by at most about one ulp of the dtype). Scores of
    causal non-candidates are 0 (the reference has NaN there in rows that hold a NaN; the
    selection never reads them). A NaN in a query makes its strided row's scores NaN, a
    NaN in a key the scores of every row that can see it: as the reference.

Cost model (per batch and query head; S tokens, head dim D, stride st, block b)
    GEMM: ``(S/st)^2`` scores of ``st*D`` products: ``S^2*D/st`` multiply-adds, ``2*S^2*D/st``
    flop per pass; dense attention is ``4*S^2*D`` flop (two GEMMs). Share per pass
    ``1/(2*st)``: 6.25% at stride 8, 3.1% at stride 16 (``passes=2`` doubles it).
    ``exp``: ``(S/st)^2`` per pass against ``S^2`` in attention (1.6% / 0.4%). Memory: q
    and k once from HBM; each program re-reads its q tile per key tile, from L2:
    ``2*BM*BN/(BM+BN)`` flop per byte, 64 at 128x128 tiles, 85 at 128x256. The workspace
    (``passes=1``) adds ``4*S^2/(st*b)`` bytes written then read per head (stride 8,
    block 128, 32k tokens: 4 MiB), small against the GEMM. The softmax epilogue of a
    128x128 tile (~10 operations per score, one ``exp``) costs roughly a third of its
    GEMM at stride 8 (K = 1024) and a sixth at stride 16 (K = 2048) unless overlapped.
    Expected on an H200: dense SDPA measured 0.63 ms at 8192 tokens and 11.6 ms at 32760
    (12 heads, D 128, bf16; about 560-660 TFLOP/s, benchmarks/gpu/results/h200-check.json);
    with this GEMM at 400-550 TFLOP/s, ``passes=1`` costs about 3.5-5% of dense attention
    at stride 16 and 7-9.5% at stride 8, ``passes=2`` twice that; the selection (a sort
    over ``[B*N*Qb, KVb]`` and ~20 small kernels, ~0.1-0.3 ms) comes on top and dominates
    at 8k tokens. So the 5%-at-32k target is within reach at stride 16 with ``passes=1``
    only. benchmarks/gpu/estimate.py measures all of it.

Tiles (:func:`default_tiles`)
    16-bit inputs: 128x128 with ``BLOCK_D = 64``, 8 warps, 3 stages (an accumulator of 64
    fp32 registers per thread; 96 KiB of shared memory for the stages); 64 query rows
    when 128 would leave fewer than two waves of programs on the GPU (8k tokens, 12
    heads at stride 16: 48 programs of 128 rows for 132 SMs). fp32: 64x64 with 32-wide
    chunks (IEEE fp32 dots run on CUDA cores). Tiles hold whole blocks: ``BLOCK_M`` and
    ``BLOCK_N`` are raised to the next power of two of ``block_size / stride`` (the op
    sends at most 128 here). Candidates for the GPU script's sweep: 128x256 (more flop
    per byte of L2), 64x128 with 4 warps, 2-4 stages. Not autotuned: a tuning run at each
    new sequence length would stall the first denoising step; the sweep fixes defaults.
    On CPU tensors (the interpreter, which pays per operation) the largest tiles run.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from ditops.kernels.opaque import opaque_op
from ditops.kernels.triton.rows import round_rne

#: Most bytes of ``passes=1`` workspace one launch uses; more heads launch in groups.
WORKSPACE_BYTES = 128 << 20
#: SMs assumed where torch cannot say (xpu): an H100/H200's count.
DEFAULT_SMS = 132


# Triton's interpreter multiplies the bit patterns of bf16 operands in tl.dot (issue
# triton-lang/triton#11584): there they go to fp32 first (exact: bf16 products fit in fp32).
BF16_DOT_IN_FP32 = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@dataclass(frozen=True)
class Tiles:
    """Launch parameters: strided rows and columns per tile, head-dim chunk, warps, stages."""

    block_m: int = 128
    block_n: int = 128
    block_d: int = 64
    num_warps: int = 8
    num_stages: int = 3


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr):
    """``acc + a @ b`` in fp32 (``acc`` may be None)."""
    if BF16_DOT_IN_FP32 and a.dtype == tl.bfloat16:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _tile_scores(
    Q, K, t, qb, q_tok, row_ok, q_len, kv_len, k_cols, s_qs, s_qd, s_ks, s_kd,
    STRIDE: tl.constexpr, D: tl.constexpr, CELLS: tl.constexpr, CELLS_P2: tl.constexpr,
    CAUSAL: tl.constexpr, PRECISION: tl.constexpr, KBT: tl.constexpr, CHUNKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """fp32 scores of key tile ``t`` (-inf where no key or not a candidate), and validity.

    ``Q``/``K`` point at the head; ``q_tok`` is the first token of each strided row. The
    GEMM is rounded once to the inputs' dtype. Query offset ``j`` of a group meets key
    offset ``STRIDE - 1 - j``.
    """
    col = tl.arange(0, BLOCK_N)
    kb = t * KBT + col // CELLS_P2
    cols = kb * CELLS + col % CELLS_P2
    col_ok = (col % CELLS_P2 < CELLS) & (cols < k_cols)
    k_tok = cols.to(tl.int64) * STRIDE
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for step in range(STRIDE * CHUNKS):
        j = step // CHUNKS
        d = (step % CHUNKS) * BLOCK_D + tl.arange(0, BLOCK_D)
        qt = q_tok + j
        kt = k_tok + (STRIDE - 1 - j)
        q = tl.load(
            Q + qt[:, None] * s_qs + d[None, :] * s_qd,
            mask=(row_ok & (qt < q_len))[:, None] & (d < D)[None, :],
            other=0.0,
        )
        k = tl.load(
            K + kt[None, :] * s_ks + d[:, None] * s_kd,
            mask=(col_ok & (kt < kv_len))[None, :] & (d < D)[:, None],
            other=0.0,
        )
        acc = _dot(q, k, acc, PRECISION)
    s = round_rne(acc, Q.dtype.element_ty).to(tl.float32)
    valid = col_ok[None, :]
    if CAUSAL:
        valid = valid & (kb[None, :] <= qb[:, None])
    return tl.where(valid, s, float("-inf")), valid


@triton.jit
def _block_scores_kernel(
    Q, K, Out, Work, Mtile,
    q_len, kv_len, q_rows, k_cols, q_blocks, kv_blocks, m_pitch, bh0, heads, group,
    s_qb, s_qh, s_qs, s_qd, s_kb, s_kh, s_ks, s_kd,
    STRIDE: tl.constexpr, D: tl.constexpr, CELLS: tl.constexpr, CELLS_P2: tl.constexpr,
    CAUSAL: tl.constexpr, ONE_PASS: tl.constexpr, PRECISION: tl.constexpr,
    QBT: tl.constexpr, KBT: tl.constexpr, KBT_PAD: tl.constexpr, CHUNKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Block scores of ``QBT`` query blocks of one (batch, head) into Out.

    Lane ``i`` of a tile is cell ``i % CELLS_P2`` of block ``i // CELLS_P2`` (cells past
    ``CELLS`` are padding lanes when ``CELLS`` is not a power of two), so a tile holds
    ``QBT = BLOCK_M / CELLS_P2`` query blocks; the same holds for columns and the ``KBT``
    key blocks of a key tile (``KBT_PAD >= 16`` columns in the pooling matmul). The head
    dim is read in ``CHUNKS`` chunks of ``BLOCK_D``.
    """
    DTYPE = Q.dtype.element_ty
    bh_local = tl.program_id(1)
    bh = bh0 + bh_local
    b, h = bh // heads, bh % heads
    Q += b.to(tl.int64) * s_qb + h.to(tl.int64) * s_qh
    K += b.to(tl.int64) * s_kb + (h // group).to(tl.int64) * s_kh

    lane = tl.arange(0, BLOCK_M)
    qb = tl.program_id(0) * QBT + lane // CELLS_P2
    rows = qb * CELLS + lane % CELLS_P2
    row_ok = (lane % CELLS_P2 < CELLS) & (rows < q_rows)
    q_tok = rows.to(tl.int64) * STRIDE
    # 0/1 pooling matrix: column lane -> its key block within the tile.
    kb_pad = tl.arange(0, KBT_PAD)
    pool = ((tl.arange(0, BLOCK_N) // CELLS_P2)[:, None] == kb_pad[None, :]).to(tl.float32)
    pool = pool.to(DTYPE)  # via fp32: the interpreter casts int1 to bf16 as bits
    n_kb = kv_blocks
    if CAUSAL:
        n_kb = tl.minimum(tl.minimum((tl.program_id(0) + 1) * QBT, q_blocks), kv_blocks)
    n_tiles = tl.cdiv(n_kb, KBT)
    # Workspace rows of this program (passes=1): block sums and each tile's running max.
    w_rows = (bh_local.to(tl.int64) * q_rows + rows) * kv_blocks
    m_rows = (bh_local.to(tl.int64) * q_rows + rows) * m_pitch
    m_run = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_run = tl.zeros([BLOCK_M], dtype=tl.float32)
    for t in range(n_tiles):
        s, valid = _tile_scores(
            Q, K, t, qb, q_tok, row_ok, q_len, kv_len, k_cols, s_qs, s_qd, s_ks, s_kd,
            STRIDE, D, CELLS, CELLS_P2, CAUSAL, PRECISION, KBT, CHUNKS, BLOCK_M, BLOCK_N, BLOCK_D,
        )  # fmt: skip
        m_new = tl.maximum(m_run, tl.max(s, axis=1))
        p = tl.where(valid, tl.exp(s - m_new[:, None]), 0.0)
        l_run = l_run * tl.exp(m_run - m_new) + tl.sum(p, axis=1)
        m_run = m_new
        if ONE_PASS:
            part = _dot(round_rne(p, DTYPE), pool, None, PRECISION)
            kb_w = t * KBT + kb_pad
            w_ok = row_ok[:, None] & ((kb_pad < KBT) & (kb_w < kv_blocks))[None, :]
            tl.store(Work + w_rows[:, None] + kb_w[None, :], part, mask=w_ok)
            tl.store(Mtile + m_rows + t, m_run, mask=row_ok)
    inv_l = tl.math.div_rn(1.0, l_run)
    if ONE_PASS:
        tl.debug_barrier()  # other threads of this program stored the workspace rows
    out_qb = tl.program_id(0) * QBT + tl.arange(0, QBT)
    for t in range(n_tiles):
        kb_out = t * KBT + kb_pad
        kb_ok = (kb_pad < KBT) & (kb_out < kv_blocks)
        if ONE_PASS:
            part = tl.load(
                Work + w_rows[:, None] + kb_out[None, :], mask=row_ok[:, None] & kb_ok[None, :]
            )
            m_t = tl.load(Mtile + m_rows + t, mask=row_ok)
            per_row = part * (tl.exp(m_t - m_run) * inv_l)[:, None]
        else:
            s, valid = _tile_scores(
                Q, K, t, qb, q_tok, row_ok, q_len, kv_len, k_cols, s_qs, s_qd, s_ks, s_kd,
                STRIDE, D, CELLS, CELLS_P2, CAUSAL, PRECISION, KBT, CHUNKS,
                BLOCK_M, BLOCK_N, BLOCK_D,
            )  # fmt: skip
            p = round_rne(tl.exp(s - m_run[:, None]) * inv_l[:, None], DTYPE)
            per_row = _dot(tl.where(valid, p, 0.0).to(DTYPE), pool, None, PRECISION)
        per_row = tl.where(row_ok[:, None], round_rne(per_row, DTYPE).to(tl.float32), 0.0)
        total = tl.sum(tl.reshape(per_row, (QBT, CELLS_P2, KBT_PAD)), axis=1)
        if CAUSAL:
            # Non-candidates hold 0, also in NaN rows (the pooling matmul spreads a NaN).
            total = tl.where(kb_out[None, :] <= out_qb[:, None], total, 0.0)
        tl.store(
            Out + (bh.to(tl.int64) * q_blocks + out_qb)[:, None] * kv_blocks + kb_out[None, :],
            total,
            mask=(out_qb < q_blocks)[:, None] & kb_ok[None, :],
        )


def default_tiles(dtype: torch.dtype, programs: int, device: torch.device) -> Tiles:
    """Tiles for H100/H200-class GPUs (module docstring); ``programs``: at 128 rows a tile."""
    if dtype == torch.float32:
        return Tiles(block_m=64, block_n=64, block_d=32, num_warps=4, num_stages=2)
    # The interpreter (CPU tensors) pays per operation: the fewest programs are fastest.
    if device.type != "cpu" and programs < 2 * _sm_count(device):
        return Tiles(block_m=64)
    return Tiles()


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return DEFAULT_SMS


def launch(
    q: Tensor,
    k: Tensor,
    out: Tensor,
    *,
    block_size: int,
    stride: int,
    causal: bool,
    passes: int = 1,
    tiles: Tiles | None = None,
) -> None:
    """Write block scores of scaled BNSD-view ``q`` (already ``q * scale / stride`` in its
    dtype) and ``k`` into ``out`` (fp32 ``[B, Nq, Qb, KVb]``, contiguous, zeroed)."""
    batch, heads, q_len, dim = (int(s) for s in q.shape)
    kv_heads, kv_len = int(k.shape[1]), int(k.shape[2])
    cells = block_size // stride
    cells_p2 = triton.next_power_of_2(cells)
    q_rows, k_cols = math.ceil(q_len / stride), math.ceil(kv_len / stride)
    q_blocks, kv_blocks = int(out.shape[2]), int(out.shape[3])
    if tiles is None:
        tiles = default_tiles(q.dtype, triton.cdiv(q_rows, 128) * batch * heads, q.device)
    for name in ("block_m", "block_n", "block_d"):
        size = getattr(tiles, name)
        if size < 16 or size & (size - 1):
            raise ValueError(f"Tiles.{name} must be a power of two >= 16, got {size}")
    # Tiles hold whole blocks: at least one block of rows and of columns.
    block_m, block_n = max(tiles.block_m, cells_p2), max(tiles.block_n, cells_p2)
    block_d = min(tiles.block_d, max(16, triton.next_power_of_2(dim)))
    qbt, kbt = block_m // cells_p2, block_n // cells_p2
    n_tiles = triton.cdiv(kv_blocks, kbt)
    bh_total = batch * heads
    per_bh = q_rows * (kv_blocks + n_tiles) * 4
    chunk = bh_total if passes == 2 else max(1, min(bh_total, WORKSPACE_BYTES // max(per_bh, 1)))
    work = mtile = out  # unused when passes == 2
    if passes == 1:
        work = torch.empty(chunk * q_rows * kv_blocks, dtype=torch.float32, device=q.device)
        mtile = torch.empty(chunk * q_rows * n_tiles, dtype=torch.float32, device=q.device)
    # No TF32 for fp32 inputs (the reference is fp32); 16-bit dots take the default.
    precision = "ieee" if q.dtype == torch.float32 else None
    for bh0 in range(0, bh_total, chunk):
        grid = (triton.cdiv(q_blocks, qbt), min(chunk, bh_total - bh0))
        _block_scores_kernel[grid](
            q, k, out, work, mtile,
            q_len, kv_len, q_rows, k_cols, q_blocks, kv_blocks, n_tiles, bh0, heads,
            heads // kv_heads, *q.stride(), *k.stride(),
            STRIDE=stride, D=dim, CELLS=cells, CELLS_P2=cells_p2, CAUSAL=causal,
            ONE_PASS=passes == 1, PRECISION=precision,
            QBT=qbt, KBT=kbt, KBT_PAD=max(16, kbt), CHUNKS=triton.cdiv(dim, block_d),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
            num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        )  # fmt: skip


def _new_scores(q: Tensor, k: Tensor, block_size: int) -> Tensor:
    q_blocks = math.ceil(int(q.shape[2]) / block_size)
    kv_blocks = math.ceil(int(k.shape[2]) / block_size)
    return torch.zeros(
        int(q.shape[0]), int(q.shape[1]), q_blocks, kv_blocks, dtype=torch.float32, device=q.device
    )


@opaque_op("ditops::triton_estimate_block_scores")
def _triton_block_scores(
    q: Tensor,
    k: Tensor,
    block_size: int,
    stride: int,
    score_scale: float,
    causal: bool,
    passes: int,
) -> Tensor:
    out = _new_scores(q, k, block_size)
    # The reference's own expression, so q * scale rounds to the dtype as there.
    launch(
        q * score_scale, k, out, block_size=block_size, stride=stride, causal=causal, passes=passes
    )
    return out


_triton_block_scores.register_fake(
    lambda q, k, block_size, stride, score_scale, causal, passes: _new_scores(q, k, block_size)
)


def block_scores(
    q: Tensor,
    k: Tensor,
    *,
    block_size: int,
    stride: int,
    score_scale: float,
    causal: bool,
    passes: int = 1,
) -> Tensor:
    """fp32 ``[B, Nq, Qb, KVb]`` block scores of BNSD views ``q``/``k`` (any strides).

    Same arguments and meaning as :func:`ditops.attention.estimate.block_scores` (checked
    by the op); ``passes`` picks the softmax schedule (module docstring).
    """
    if passes not in (1, 2):
        raise ValueError(f"passes must be 1 or 2, got {passes!r}")
    return _triton_block_scores(q, k, block_size, stride, float(score_scale), causal, passes)
