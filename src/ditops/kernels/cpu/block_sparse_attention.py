"""Block-sparse attention on CPU: gather the selected key blocks, run SDPA on them.

For each query block (one ``(batch, head, query block)`` row of the block mask) the
keys it attends to are copied next to each other and ``F.scaled_dot_product_attention``
(ATen's CPU flash kernel) runs on ``[rows, 1, block, D]`` queries against
``[rows, 1, T, D]`` gathered keys and values. Rows with the same shape of work (query
rows, gathered keys, causal offset) form a bucket, served by one SDPA call per chunk.

Why: no compilation (FlexAttention compiles ~15 s per new shape), and on the project
CPU (AVX2, no AMX) the flash kernel is faster per key than FlexAttention's CPU
template, about 2x in bf16 (``benchmarks/cpu/probes/sparse_attention_cpu.py``). What it
costs: the copy of the selected keys and values (``keep x`` the inputs per query
block, a few % of the time), and 128-row queries, on which the flash kernel works in
32-row tiles where a dense call uses 256-row ones (measured on gathered data: 0.73-0.84
of dense SDPA's speed per key, the ceiling of this design).

Parallel regions: every ATen call that splits work over threads wakes the worker
threads, which on a busy machine costs milliseconds. So the copies are few and big:
up to ``WORKSPACE_BYTES`` of keys (and of values) per group of rows, gathered with one
copy each for all the buckets in the group, and the outputs written once per group.
The buffers are kept between calls (fresh ones would page-fault on every call: field
notes, glibc malloc); :func:`release_workspace` frees them.

Meaning (see :mod:`ditops.attention.reference`): softmax over the union of the
selected key blocks; a row with none outputs zeros; GQA maps query head ``n`` to key
head ``n // (Nq / Nkv)``; the last block of a sequence may be partial. Selected blocks
are gathered in ascending order, so a partial last key block is always the last one
gathered and simply shortens ``T``. Causal (top-left aligned) drops the blocks past the
diagonal; the diagonal block, when selected, is the last gathered and gets the one
element mask of its bucket, ``t <= offset + i`` (broadcast over its rows).

Precision: SDPA computes in fp32 and, for bf16/fp16, rounds the probabilities to the
input dtype before multiplying by ``V``, as every flash kernel does (and
FlexAttention): the op's ``fast`` tolerance covers it.

NaN/inf: only the selected blocks are read. A NaN in a query row, or in a selected key
or value, gives NaN in the rows that read it (SDPA propagates it); a NaN in a block
that is not selected is never read, so it does not reach the output (the meaning's
``0 * NaN`` in its dense ``P @ V`` does spread NaN in ``V`` from unselected blocks).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ditops.kernels.opaque import opaque_op

#: Bytes of gathered keys (and as many of values) per group of rows, kept between
#: calls. 64 MiB is 128 rows of 2048 bf16 keys at d=128 (keep 0.25 at 8k tokens): six
#: groups for 12 heads. Chunks of 16 MiB were as fast on 1 thread and slower on 2
#: threads of a busy machine (more parallel regions).
WORKSPACE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class Bucket:
    """Rows of the block mask that one batch of SDPA calls serves.

    ``rows``: flat ``(b * N + n) * Qb + r`` row ids; ``blocks``: ``[rows, count]``
    selected key blocks of each row, ascending; ``q_len``: real query rows of the block;
    ``kv_len``: gathered keys; ``causal_offset``: ``-1`` when every gathered key is
    visible, else the number of gathered keys before the diagonal block.
    """

    rows: torch.Tensor
    blocks: torch.Tensor
    q_len: int
    kv_len: int
    causal_offset: int


def plan_buckets(
    mask: torch.Tensor, *, q_len: int, kv_len: int, block_size: int, causal: bool
) -> tuple[list[Bucket], torch.Tensor]:
    """Group the rows of a ``[B, N, Qb, >=KVb]`` 0/1 mask into :class:`Bucket` s.

    Returns the buckets and the flat ids of the rows that select nothing (their queries
    output zeros).
    """
    q_blocks = -(-q_len // block_size)
    kv_blocks = -(-kv_len // block_size)
    sel = mask[..., :kv_blocks].to(torch.bool)
    dev = mask.device
    if causal:
        # Top-left aligned: query block r sees key blocks 0..r (block r partly).
        r = torch.arange(q_blocks, device=dev)[:, None]
        j = torch.arange(kv_blocks, device=dev)[None, :]
        sel = sel & (j <= r)
    sel = sel.reshape(int(sel.shape[0]) * int(sel.shape[1]) * q_blocks, kv_blocks)
    counts = sel.sum(-1)
    # Ascending selected block ids first (a stable sort of the 1s before the 0s).
    order = torch.argsort(sel.to(torch.int8), dim=-1, descending=True, stable=True)
    q_block = torch.arange(sel.shape[0], device=dev) % q_blocks
    q_rows = (q_len - q_block * block_size).clamp(max=block_size)
    keys = counts * block_size
    tail = kv_len - (kv_blocks - 1) * block_size
    if kv_blocks and tail < block_size:
        keys = keys - sel[:, -1].long() * (block_size - tail)
    offset = torch.full_like(counts, -1)
    if causal:
        on_diag = q_block < kv_blocks
        diag = torch.zeros_like(on_diag)
        diag[on_diag] = sel[on_diag, q_block[on_diag]]
        offset = torch.where(diag, (counts - 1) * block_size, offset)
    empty = (counts == 0).nonzero().flatten()
    live = counts > 0
    table = torch.stack([q_rows, keys, offset, counts], dim=-1)[live]
    ids = live.nonzero().flatten()
    if ids.numel() == 0:
        return [], empty
    shapes, inverse = torch.unique(table, dim=0, return_inverse=True)
    buckets = []
    for i, (lq, lk, off, count) in enumerate(shapes.tolist()):
        rows = ids[inverse == i]
        buckets.append(Bucket(rows, order[rows, :count], lq, lk, off))
    return buckets, empty


class _Rows:
    """A BNSD-viewed tensor as rows of its last dim, addressed by (batch, head, token).

    Rows are read through one ``[M, D]`` view when the strides allow it (unit stride
    on D, the others multiples of D: contiguous BNSD or BSND, or a slice of a packed
    qkv tensor); otherwise the tensor is copied to contiguous BNSD first. When a head's
    tokens are consecutive rows in whole blocks (contiguous BNSD, length a multiple of
    the block), ``blocks`` views them as ``[M / block, block * D]``: one index per block
    instead of one per token.
    """

    def __init__(self, x: torch.Tensor, block_size: int) -> None:
        dim = int(x.shape[-1])
        sizes = [int(s) for s in x.shape]
        strides = [int(s) for s in x.stride()]
        usable = (strides[3] == 1 or sizes[3] == 1) and all(
            s % dim == 0 or n == 1 for s, n in zip(strides[:3], sizes[:3])
        )
        if not usable:
            x = x.contiguous()
            strides = [int(s) for s in x.stride()]
        rb, rn, rs = (s // dim if n > 1 else 0 for s, n in zip(strides[:3], sizes[:3]))
        rows = 1 + rb * (sizes[0] - 1) + rn * (sizes[1] - 1) + rs * (sizes[2] - 1)
        self.dim, self.block = dim, block_size
        self.rb, self.rn, self.rs = rb, rn, rs
        self.flat = x.as_strided((rows, dim), (dim, 1), x.storage_offset())
        self.blocks: torch.Tensor | None = None
        aligned = rows % block_size == 0 and rb % block_size == 0 and rn % block_size == 0
        if (rs == 1 or sizes[2] == 1) and aligned:
            self.blocks = self.flat.view(rows // block_size, block_size * dim)

    def start(self, b: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        """Row of token 0 of (batch b, head n)."""
        return b * self.rb + n * self.rn

    def _ids(self, parts: list[_Part]) -> tuple[torch.Tensor, bool]:
        """Indices of the parts' rows: of whole blocks in ``blocks`` when every part is
        made of whole blocks and the view exists (True), else of rows in ``flat``."""
        if self.blocks is not None and all(p.length == p.blocks.shape[1] * self.block
                                           for p in parts):  # fmt: skip
            ids = [((p.start // self.block)[:, None] + p.blocks).reshape(-1) for p in parts]
            return torch.cat(ids) if len(ids) > 1 else ids[0], True
        rows = []
        for p in parts:
            pos = p.blocks[:, :, None] * self.block + torch.arange(self.block)
            pos = pos.reshape(p.blocks.shape[0], -1)[:, : p.length]
            rows.append((p.start[:, None] + pos * self.rs).reshape(-1))
        return torch.cat(rows) if len(rows) > 1 else rows[0], False

    def _run(self, ids: torch.Tensor) -> int | None:
        """The first index when ``ids`` are consecutive, else None."""
        first = int(ids[0])
        return first if bool((ids == torch.arange(first, first + ids.numel())).all()) else None

    def gather(self, parts: list[_Part], buf: torch.Tensor) -> torch.Tensor:
        """The parts' rows one after the other, ``[sum(rows * length), D]``: one copy
        into ``buf``, or a view when they are consecutive whole blocks."""
        ids, whole = self._ids(parts)
        total = sum(int(p.start.shape[0]) * p.length for p in parts)
        if whole:
            first = self._run(ids)
            if first is not None:
                return self.blocks[first : first + ids.numel()].view(-1, self.dim)
            out = buf[: total * self.dim].view(-1, self.block * self.dim)
            return torch.index_select(self.blocks, 0, ids, out=out).view(-1, self.dim)
        out = buf[: total * self.dim].view(total, self.dim)
        return torch.index_select(self.flat, 0, ids, out=out)

    def scatter(self, parts: list[_Part], pieces: list[torch.Tensor]) -> None:
        """Write ``cat(pieces)`` to the parts' rows (the inverse of :meth:`gather`)."""
        ids, whole = self._ids(parts)
        if whole:
            first = self._run(ids)
            if first is not None:
                dest = self.blocks[first : first + ids.numel()].view(-1, self.dim)
                if len(pieces) > 1:
                    torch.cat(pieces, out=dest)
                else:
                    dest.copy_(pieces[0])
                return
            src = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
            self.blocks.index_copy_(0, ids, src.view(ids.numel(), -1))
            return
        self.flat.index_copy_(0, ids, torch.cat(pieces) if len(pieces) > 1 else pieces[0])


class _Part(NamedTuple):
    """Rows to gather: for each row, the whole blocks ``blocks[i]`` (ascending) of the
    sequence starting at row ``start[i]``, ``length`` rows of them (the last block may
    be partial)."""

    start: torch.Tensor
    blocks: torch.Tensor
    length: int


#: Scratch buffers kept between calls (one set, taken by one call at a time): fresh
#: ones would page-fault on every call (field notes, glibc malloc).
_kept: list[torch.Tensor] = []
_kept_lock = threading.Lock()


@contextlib.contextmanager
def _workspace(*wants: tuple[int, torch.dtype]) -> Iterator[list[torch.Tensor]]:
    """Flat buffers of at least ``numel`` elements of ``dtype``, reused across calls."""
    if not _kept_lock.acquire(blocking=False):
        # Another thread holds the kept set: this call gets its own.
        yield [torch.empty(numel, dtype=dtype) for numel, dtype in wants]
        return
    try:
        for i, (numel, dtype) in enumerate(wants):
            if i == len(_kept):
                _kept.append(torch.empty(0, dtype=dtype))
            kept = _kept[i]
            if kept.dtype != dtype or kept.numel() < numel:
                _kept[i] = torch.empty(0)  # free the old one first
                _kept[i] = torch.empty(numel, dtype=dtype)
        yield [_kept[i] for i in range(len(wants))]
    finally:
        _kept_lock.release()


def release_workspace() -> None:
    """Free the scratch buffers kept between calls."""
    with _kept_lock:
        _kept.clear()


@opaque_op("ditops::cpu_gathered_block_sparse_attention")
def gathered_block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    causal: bool,
    block_size: int,
    bsnd_out: bool,
) -> torch.Tensor:
    """Block-sparse attention of BNSD-viewed ``q``/``k``/``v`` (any row-aligned strides).

    ``mask``: 0/1 ``[B, Nq, Qb, >=KVb]``. Returns the output contiguous in BSND when
    ``bsnd_out`` (as ``[B, S, N, Dv]``), else contiguous BNSD.
    """
    batch, heads, q_len, _ = (int(s) for s in q.shape)
    kv_heads, kv_len, v_dim = int(k.shape[1]), int(k.shape[2]), int(v.shape[3])
    group = heads // kv_heads
    shape = (batch, q_len, heads, v_dim) if bsnd_out else (batch, heads, q_len, v_dim)
    out = torch.empty(shape, dtype=q.dtype, device=q.device)
    if q_len == 0 or kv_len == 0:
        return out.zero_()  # no keys: every query outputs zeros
    buckets, empty = plan_buckets(
        mask, q_len=q_len, kv_len=kv_len, block_size=block_size, causal=causal
    )
    qr, kr, vr = _Rows(q, block_size), _Rows(k, block_size), _Rows(v, block_size)
    outr = _Rows(out.transpose(1, 2) if bsnd_out else out, block_size)
    q_blocks = -(-q_len // block_size)
    q_tail = q_len - (q_blocks - 1) * block_size

    def query_part(rows: torch.Tensor, length: int, table: _Rows) -> _Part:
        """The query (or output) block of each flat mask row."""
        bh = rows // q_blocks
        return _Part(table.start(bh // heads, bh % heads), (rows % q_blocks)[:, None], length)

    def key_part(rows: torch.Tensor, blocks: torch.Tensor, length: int, table: _Rows) -> _Part:
        bh = rows // q_blocks
        return _Part(table.start(bh // heads, (bh % heads) // group), blocks, length)

    if empty.numel():
        # Rows with no key: zeros, as in the meaning.
        last = empty % q_blocks == q_blocks - 1
        for rows, length in ((empty[~last], block_size), (empty[last], q_tail)):
            if rows.numel():
                zeros = out.new_zeros(rows.numel() * length, v_dim)
                outr.scatter([query_part(rows, length, outr)], [zeros])

    # Work in groups: each group's keys, values and queries are gathered with one copy
    # each (one parallel region; on a busy machine each costs a thread wake-up, which
    # is milliseconds), then SDPA runs once per bucket in the group.
    per_chunk = max(1, WORKSPACE_BYTES // q.element_size() // max(qr.dim, vr.dim))
    groups: list[list[tuple[Bucket, int, int]]] = [[]]
    used = 0
    for bk in buckets:
        width = max(bk.kv_len, bk.q_len)
        step = max(1, per_chunk // width)
        for first in range(0, bk.rows.numel(), step):
            last = min(first + step, bk.rows.numel())
            cost = (last - first) * width
            if used + cost > per_chunk and groups[-1]:
                groups.append([])
                used = 0
            groups[-1].append((bk, first, last))
            used += cost
    kv_rows = max(sum((e - f) * bk.kv_len for bk, f, e in g) for g in groups)
    q_rows = max(sum((e - f) * bk.q_len for bk, f, e in g) for g in groups)
    with _workspace(
        (kv_rows * kr.dim, k.dtype), (kv_rows * vr.dim, v.dtype), (q_rows * qr.dim, q.dtype)
    ) as (k_buf, v_buf, q_buf):
        for segments in groups:
            if not segments:
                continue
            qp, kp, vp, op = [], [], [], []
            for bk, first, last in segments:
                rows, blocks = bk.rows[first:last], bk.blocks[first:last]
                qp.append(query_part(rows, bk.q_len, qr))
                op.append(query_part(rows, bk.q_len, outr))
                kp.append(key_part(rows, blocks, bk.kv_len, kr))
                vp.append(key_part(rows, blocks, bk.kv_len, vr))
            qs, ks, vs = qr.gather(qp, q_buf), kr.gather(kp, k_buf), vr.gather(vp, v_buf)
            pieces = []
            q_at = kv_at = 0
            for bk, first, last in segments:
                n = last - first
                attn_mask = None
                if bk.causal_offset >= 0:
                    i = torch.arange(bk.q_len)[:, None]
                    t = torch.arange(bk.kv_len)[None, :]
                    attn_mask = t <= bk.causal_offset + i
                o = F.scaled_dot_product_attention(
                    qs[q_at : q_at + n * bk.q_len].view(n, 1, bk.q_len, qr.dim),
                    ks[kv_at : kv_at + n * bk.kv_len].view(n, 1, bk.kv_len, kr.dim),
                    vs[kv_at : kv_at + n * bk.kv_len].view(n, 1, bk.kv_len, vr.dim),
                    attn_mask=attn_mask,
                    scale=scale,
                )
                pieces.append(o.view(-1, v_dim))
                q_at += n * bk.q_len
                kv_at += n * bk.kv_len
            outr.scatter(op, pieces)
    return out


@gathered_block_sparse_attention.register_fake
def _(q, k, v, mask, scale, causal, block_size, bsnd_out):
    batch, heads, q_len = q.shape[0], q.shape[1], q.shape[2]
    shape = (batch, q_len, heads, v.shape[3]) if bsnd_out else (batch, heads, q_len, v.shape[3])
    return q.new_empty(shape)
