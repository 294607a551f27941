"""Block-sparse attention on CPU: gather the selected key blocks, run SDPA on them.

For each query block (one ``(batch, head, query block)`` row of the block mask) the
keys it attends to are copied next to each other and ``F.scaled_dot_product_attention``
(ATen's CPU flash kernel) runs on ``[rows, 1, block, D]`` queries against
``[rows, 1, T, D]`` gathered keys and values. Rows with the same shape of work (query
rows, gathered keys, causal offset) form a bucket, served by one SDPA call per chunk.

Why: no compilation (FlexAttention compiles each new shape, for seconds), and on CPUs
without AMX the flash kernel is faster per key than FlexAttention's CPU template
(``benchmarks/cpu/probes/sparse_attention_cpu.py`` measures both). What it
costs: the copy of the selected keys and values (``keep x`` the inputs per query
block, a few % of the time), and 128-row queries, on which the flash kernel works in
32-row tiles where a dense call uses 256-row ones (the ceiling of this design:
``benchmarks/cpu/probes/sparse_attention_parts.py`` measures the speed per key).

Pairs (not causal; off by default since the groups run on worker threads, see
``PAIR_QUERY_BLOCKS``): two neighbouring query blocks of a head whose selections mostly
agree (``PAIR_MIN_SHARED``) run as one 256-row query over the key blocks both select
(64-row tiles), and each block then runs alone over the blocks only it selects; the two
parts are merged through their log-sum-exps (``w = exp(lse - max)``, in fp32). Video
masks pair often (neighbouring tokens attend alike; the gain is recorded in
``benchmarks/cpu/probes/sparse_attention_cpu.txt``), random ones rarely. The pair's
output is rounded to the output dtype before the merge: one extra rounding for the
rows that have private blocks, within the ``fast`` tolerance.

Parallel regions: every ATen call that splits work over threads wakes the worker
threads, which on a busy machine costs milliseconds. So the copies are few and big:
up to ``WORKSPACE_BYTES`` of keys (and of values) per group of rows, gathered with one
copy each for all the buckets in the group, and the outputs written once per group.
The buffers are kept between calls (fresh ones would page-fault on every call: field
notes, glibc malloc); :func:`release_workspace` frees them. With ``SHARE_GROUPS`` (the
default) the groups are handed out to :mod:`ditops.kernels.cpu.workers` threads, one
intra-op thread each, with ``SHARED_WORKSPACE_BYTES`` buffers from each worker's scratch
(kept per thread; :func:`ditops.kernels.cpu.blocks.release` frees a thread's): while one
thread copies keys the other attends, and no call waits at a barrier for a descheduled
thread (the plan runs on one thread for the same reason).

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

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ditops.kernels.cpu import workers
from ditops.kernels.cpu.blocks import Scratch, kernel_threads
from ditops.kernels.cpu.gathered_rows import Part, Rows, release_workspace, workspace
from ditops.kernels.opaque import opaque_op

__all__ = ["gathered_block_sparse_attention", "plan_buckets", "release_workspace"]

#: Bytes of gathered keys (and as many of values) per group of rows, kept between
#: calls. 64 MiB is 128 rows of 2048 bf16 keys at d=128 (keep 0.25 at 8k tokens): six
#: groups for 12 heads. Chunks of 16 MiB were as fast on 1 thread and slower on 2
#: threads of a busy machine (more parallel regions).
WORKSPACE_BYTES = 64 * 1024 * 1024

#: Hand whole groups of rows to worker threads (:mod:`ditops.kernels.cpu.workers`), one
#: intra-op thread each, instead of running each group's copies and SDPA call on the
#: process's threads; their buffers are the workers' scratch, of
#: ``SHARED_WORKSPACE_BYTES`` per group (smaller groups: the last one claimed is short).
SHARE_GROUPS = True
SHARED_WORKSPACE_BYTES = 16 * 1024 * 1024

#: Serve neighbouring query blocks with mostly the same key blocks as pairs (see
#: :func:`plan_buckets`): SDPA on 256 query rows works in 64-row tiles instead of
#: 32-row ones. Off: with the groups on worker threads (``SHARE_GROUPS``) the pairs'
#: second phase, extra calls and merges cost more than the larger tiles gain (the
#: estimator's masks at Wan's shape, keep 0.25: 3.28x dense unpaired vs 2.86x paired at
#: load 7-8, ``benchmarks/cpu/probes/sparse_share_groups.txt``).
PAIR_QUERY_BLOCKS = False
#: ... when the blocks both select are at least this share of the larger selection.
PAIR_MIN_SHARED = 0.5

# SDPA's CPU flash kernel with its log-sum-exp (needed to merge a pair's parts); pairs
# are off if a torch build lacks it.
_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


@dataclass(frozen=True)
class Bucket:
    """Work items of one shape, served by one SDPA call per chunk.

    ``kind``: ``"single"`` (a query block over its selected key blocks), ``"pair"``
    (two neighbouring query blocks of a head over the key blocks both select) or
    ``"private"`` (a paired query block over the blocks only it selects; merged with
    its pair's result through the log-sum-exp). ``rows``: flat ``(b * N + n) * Qb + r``
    mask row ids (of the first block, for a pair); ``blocks``: ``[rows, count]`` key
    blocks of each item, ascending; ``q_len``: query rows (``2 * block`` for a pair);
    ``kv_len``: gathered keys; ``causal_offset``: ``-1`` when every gathered key is
    visible, else the number of gathered keys before the diagonal block.
    """

    kind: str
    rows: torch.Tensor
    blocks: torch.Tensor
    q_len: int
    kv_len: int
    causal_offset: int


def plan_buckets(
    mask: torch.Tensor,
    *,
    q_len: int,
    kv_len: int,
    block_size: int,
    causal: bool,
    pair: bool = False,
) -> tuple[list[Bucket], torch.Tensor]:
    """Group the rows of a ``[B, N, Qb, >=KVb]`` 0/1 mask into :class:`Bucket` s.

    With ``pair`` (not causal), query blocks ``2i`` and ``2i + 1`` of a head whose
    selections share at least half of the larger one are served as a pair over the
    shared blocks plus two private items. Returns the buckets and the flat ids of the
    rows that select nothing (their queries output zeros).
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
    q_block = torch.arange(sel.shape[0], device=dev) % q_blocks
    q_rows = (q_len - q_block * block_size).clamp(max=block_size)
    single = counts > 0
    items: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]] = []
    pairs = (q_len // block_size) // 2  # pairs of whole query blocks per head
    if pair and not causal and pairs:
        heads_rows = torch.arange(sel.shape[0] // q_blocks, device=dev)[:, None] * q_blocks
        even = (heads_rows + 2 * torch.arange(pairs, device=dev)).reshape(-1)
        both = sel[even] & sel[even + 1]
        shared = both.sum(-1)
        most = torch.maximum(counts[even], counts[even + 1])
        take = (shared > 0) & (shared >= PAIR_MIN_SHARED * most)
        first, both = even[take], both[take]
        items.append(("pair", first, both, torch.full_like(first, 2 * block_size)))
        for rows in (first, first + 1):
            items.append(("private", rows, sel[rows] & ~both, torch.full_like(rows, block_size)))
            single[rows] = False
    rows = single.nonzero().flatten()
    items.append(("single", rows, sel[rows], q_rows[rows]))

    tail = kv_len - (kv_blocks - 1) * block_size
    buckets = []
    for kind, rows, chosen, lq in items:
        count = chosen.sum(-1)
        live = count > 0
        rows, chosen, lq, count = rows[live], chosen[live], lq[live], count[live]
        if rows.numel() == 0:
            continue
        keys = count * block_size
        if kv_blocks and tail < block_size:
            keys = keys - chosen[:, -1].long() * (block_size - tail)
        offset = torch.full_like(count, -1)
        if causal:
            qb = rows % q_blocks
            on_diag = qb < kv_blocks
            diag = torch.zeros_like(on_diag)
            diag[on_diag] = chosen[on_diag, qb[on_diag]]
            offset = torch.where(diag, (count - 1) * block_size, offset)
        # Ascending chosen block ids first (a stable sort of the 1s before the 0s).
        order = torch.argsort(chosen.to(torch.int8), dim=-1, descending=True, stable=True)
        table = torch.stack([lq, keys, offset, count], dim=-1)
        shapes, inverse = torch.unique(table, dim=0, return_inverse=True)
        for i, (length, keys_i, off, n) in enumerate(shapes.tolist()):
            these = inverse == i
            buckets.append(Bucket(kind, rows[these], order[these, :n], length, keys_i, off))
    return buckets, (counts == 0).nonzero().flatten()


#: One group's work items: ``(bucket, first, last)`` slices of buckets.
Segments = list[tuple["Bucket", int, int]]


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
    # The plan's dozens of small ops on the mask run on one thread: on two, each waits
    # for a descheduled partner under load (290-380 ms vs ~15 ms at load 11-12 for
    # [1, 12, 64, 64]; benchmarks/README.md, issue 39). Same bits (small tensors).
    with kernel_threads(1):
        buckets, empty = plan_buckets(
            mask, q_len=q_len, kv_len=kv_len, block_size=block_size, causal=causal,
            pair=PAIR_QUERY_BLOCKS and _WITH_LSE is not None,
        )  # fmt: skip
    qr, kr, vr = Rows(q, block_size), Rows(k, block_size), Rows(v, block_size)
    outr = Rows(out.transpose(1, 2) if bsnd_out else out, block_size)
    q_blocks = -(-q_len // block_size)
    q_tail = q_len - (q_blocks - 1) * block_size

    def query_part(rows: torch.Tensor, length: int, table: Rows) -> Part:
        """The query (or output) block of each flat mask row; two blocks for a pair."""
        bh = rows // q_blocks
        r = (rows % q_blocks)[:, None]
        blocks = torch.cat([r, r + 1], dim=1) if length > block_size else r
        return Part(table.start(bh // heads, bh % heads), blocks, length)

    def key_part(rows: torch.Tensor, blocks: torch.Tensor, length: int, table: Rows) -> Part:
        bh = rows // q_blocks
        return Part(table.start(bh // heads, (bh % heads) // group), blocks, length)

    if empty.numel():
        # Rows with no key: zeros, as in the meaning.
        last = empty % q_blocks == q_blocks - 1
        for rows, length in ((empty[~last], block_size), (empty[last], q_tail)):
            if rows.numel():
                zeros = out.new_zeros(rows.numel() * length, v_dim)
                outr.scatter([query_part(rows, length, outr)], [zeros])

    # Pairs first: their outputs and log-sum-exps are in place when the private items
    # of the same rows are merged into them.
    pairs = [bk for bk in buckets if bk.kind == "pair"]
    others = [bk for bk in buckets if bk.kind != "pair"]
    lse = None
    if pairs:
        lse = torch.empty(int(mask.shape[0] * mask.shape[1]) * q_blocks, block_size)
    bytes_per = SHARED_WORKSPACE_BYTES if SHARE_GROUPS else WORKSPACE_BYTES
    per_chunk = max(1, bytes_per // q.element_size() // max(qr.dim, vr.dim))
    phases = [_groups(pairs, per_chunk), _groups(others, per_chunk)]
    groups = [g for p in phases for g in p]
    if not groups:
        return out  # every row selecting nothing: zeros, written above

    def serve(
        segments: Segments, k_buf: torch.Tensor, v_buf: torch.Tensor, q_buf: torch.Tensor
    ) -> None:
        """Gather one group's queries, keys and values, attend, write its outputs."""
        qp, kp, vp = [], [], []
        for bk, first, last in segments:
            rows, blocks = bk.rows[first:last], bk.blocks[first:last]
            qp.append(query_part(rows, bk.q_len, qr))
            kp.append(key_part(rows, blocks, bk.kv_len, kr))
            vp.append(key_part(rows, blocks, bk.kv_len, vr))
        qs, ks, vs = qr.gather(qp, q_buf), kr.gather(kp, k_buf), vr.gather(vp, v_buf)
        results: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]] = {}
        q_at = kv_at = 0
        for bk, first, last in segments:
            n = last - first
            args = (
                qs[q_at : q_at + n * bk.q_len].view(n, 1, bk.q_len, qr.dim),
                ks[kv_at : kv_at + n * bk.kv_len].view(n, 1, bk.kv_len, kr.dim),
                vs[kv_at : kv_at + n * bk.kv_len].view(n, 1, bk.kv_len, vr.dim),
            )
            if bk.kind == "single":
                attn_mask = None
                if bk.causal_offset >= 0:
                    i = torch.arange(bk.q_len)[:, None]
                    t = torch.arange(bk.kv_len)[None, :]
                    attn_mask = t <= bk.causal_offset + i
                o = F.scaled_dot_product_attention(*args, attn_mask=attn_mask, scale=scale)
                lse_o = None
            else:
                o, lse_o = _WITH_LSE(*args, 0.0, False, scale=scale)
            rows = bk.rows[first:last]
            results.setdefault(bk.kind, []).append((rows, o.view(-1, v_dim), lse_o))
            q_at += n * bk.q_len
            kv_at += n * bk.kv_len
        for kind, done in results.items():
            rows = torch.cat([r for r, _, _ in done]) if len(done) > 1 else done[0][0]
            length = 2 * block_size if kind == "pair" else block_size
            if kind == "single":
                parts = [query_part(r, o.shape[0] // r.numel(), outr) for r, o, _ in done]
                outr.scatter(parts, [o for _, o, _ in done])
                continue
            part = [query_part(rows, length, outr)]
            found = torch.cat([x.reshape(-1, block_size) for _, _, x in done])
            if kind == "pair":
                outr.scatter(part, [o for _, o, _ in done])
                both = torch.stack([rows, rows + 1], dim=1).reshape(-1)
                lse.index_copy_(0, both, found)
                continue
            # Private items: o = (o_pair * w_pair + o_own * w_own) / (w_pair + w_own)
            # with w = exp(lse - max): softmax over the union of both key sets.
            mine = torch.cat([o for _, o, _ in done]).view(-1, block_size, v_dim).float()
            theirs = outr.gather(part, torch.empty(mine.numel(), dtype=out.dtype))
            theirs = theirs.view(-1, block_size, v_dim).float()  # may alias out (fp32)
            their_lse = lse.index_select(0, rows)
            top = torch.maximum(found, their_lse)
            w_mine, w_theirs = (found - top).exp_(), (their_lse - top).exp_()
            merged = mine.mul_(w_mine[..., None]).add_(theirs * w_theirs[..., None])
            merged.div_((w_mine + w_theirs)[..., None])
            outr.scatter(part, [merged.to(out.dtype).view(-1, v_dim)])

    if SHARE_GROUPS:
        # Whole groups handed to worker threads (one intra-op thread each): one gathers
        # (memory) while the other attends (arithmetic), and no call waits at a barrier.
        def per_worker(scratch: Scratch) -> Callable[[Segments], None]:
            def run(segments: Segments) -> None:
                kv_n = sum((e - f) * bk.kv_len for bk, f, e in segments)
                q_n = sum((e - f) * bk.q_len for bk, f, e in segments)
                k_buf = scratch.take(0, 1, kv_n * kr.dim, k.dtype)[0]
                v_buf = scratch.take(1, 1, kv_n * vr.dim, v.dtype)[0]
                serve(segments, k_buf, v_buf, scratch.take(2, 1, q_n * qr.dim, q.dtype)[0])

            return run

        for phase in phases:  # pairs first: the private items merge into their results
            workers.run_items(phase, per_worker)
        return out
    kv_rows = max(sum((e - f) * bk.kv_len for bk, f, e in g) for g in groups)
    q_rows = max(sum((e - f) * bk.q_len for bk, f, e in g) for g in groups)
    with workspace(
        (kv_rows * kr.dim, k.dtype), (kv_rows * vr.dim, v.dtype), (q_rows * qr.dim, q.dtype)
    ) as (k_buf, v_buf, q_buf):
        for segments in groups:
            serve(segments, k_buf, v_buf, q_buf)
    return out


def _groups(buckets: list[Bucket], per_chunk: int) -> list[list[tuple[Bucket, int, int]]]:
    """Chunks of buckets ``(bucket, first, last)`` packed into groups whose gathered keys
    (or queries) stay within ``per_chunk`` rows (a lone chunk may exceed it)."""
    groups: list[list[tuple[Bucket, int, int]]] = []
    used = per_chunk + 1
    for bk in buckets:
        width = max(bk.kv_len, bk.q_len)
        step = max(1, per_chunk // width)
        for first in range(0, bk.rows.numel(), step):
            last = min(first + step, bk.rows.numel())
            cost = (last - first) * width
            if used + cost > per_chunk:
                groups.append([])
                used = 0
            groups[-1].append((bk, first, last))
            used += cost
    return groups


@gathered_block_sparse_attention.register_fake
def _(q, k, v, mask, scale, causal, block_size, bsnd_out):
    batch, heads, q_len = q.shape[0], q.shape[1], q.shape[2]
    shape = (batch, q_len, heads, v.shape[3]) if bsnd_out else (batch, heads, q_len, v.shape[3])
    return q.new_empty(shape)
