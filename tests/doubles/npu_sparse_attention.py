"""Fake CPU kernels for the sparse-attention operators of sgl-kernel-npu's doubles.

Importing this module adds ``sparse_block_estimate``, ``ada_block_sparse_attention`` and
its older name ``block_sparse_attention`` to :data:`tests.doubles.npu_attentions.FAKE_OPS`,
with the real schemas, so :func:`tests.doubles.npu_attentions.fake_attentions` (legacy
package) and :func:`tests.doubles.npu_sgl_kernel.fake_sgl_kernel_npu` (current package)
register them. The kernels are written from ``shared/docs/npu-attentions-ops.md`` without
ditops' code (straightforward per-head loops, the queries reversed as the NPU does), so a
test comparing ``forward_npu`` with ``forward_native`` checks the arguments ditops passes
*and* its vectorised reference. They check the argument contract common to both packages
(dtypes, layouts, positive dims, and the attention kernel's tiling limits: head dim
<= 512, at most 256 query heads); the current package's extra checks are in
:mod:`tests.doubles.npu_sgl_kernel`.

Estimation runs in fp32 from the inputs (no half-precision block sums): tests use inputs
whose scores are exact in every dtype, so no near-tie can differ. Attention in fp16 with
``inner_precise`` bit 0 set (high performance) holds the scores and the softmax in fp16,
as the kernel's tiling does for that mode; every other case computes in fp32.
"""

from __future__ import annotations

import math

import torch

from tests.doubles.npu_attentions import fake_op

_HALF = (torch.float16, torch.bfloat16)
_LAYOUTS = ("BNSD", "BSND", "BSH")


def _bnsd(x: torch.Tensor, layout: str, heads: int) -> torch.Tensor:
    if layout == "BNSD":
        return x
    if layout == "BSND":
        return x.transpose(1, 2)
    b, s, h = x.shape
    return x.reshape(b, s, heads, h // heads).transpose(1, 2)


def _check_common(op: str, layout: str, heads: int, kv_heads: int, q, k) -> None:
    if layout not in _LAYOUTS:
        raise RuntimeError(f"attentions.{op}: input_layout {layout!r} rejected")
    for t in (q, k):
        if t.dtype not in _HALF:
            raise RuntimeError(f"attentions.{op}: dtype {t.dtype} not supported (fp16/bf16)")
    qn = _bnsd(q, layout, heads)
    kn = _bnsd(k, layout, kv_heads)
    if qn.shape[1] != heads or kn.shape[1] != kv_heads:
        raise RuntimeError(
            f"attentions.{op}: num_heads={heads}/num_key_value_heads={kv_heads} do not match "
            f"the tensors ({qn.shape[1]}/{kn.shape[1]})"
        )
    if heads % kv_heads:
        raise RuntimeError(f"attentions.{op}: num_heads must be a multiple of kv heads")
    if any(d <= 0 for t in (q, k) for d in t.shape):
        raise RuntimeError(f"attentions.{op}: dims must be positive, got {list(q.shape)}")


@fake_op(
    "sparse_block_estimate",
    "(Tensor query, Tensor key, int[]? actual_seq_lengths=None, "
    "int[]? actual_seq_lengths_kv=None, str input_layout='BNSD', int stride=8, "
    "int sparse_size=128, int num_heads=1, int num_key_value_heads=1, float scale_value=1, "
    "float threshold=1, bool causal=True, bool keep_sink=True, bool keep_recent=True, "
    "float row_sparse=1) -> (Tensor, Tensor)",
)
def sparse_block_estimate(
    query,
    key,
    actual_seq_lengths,
    actual_seq_lengths_kv,
    input_layout,
    stride,
    sparse_size,
    num_heads,
    num_key_value_heads,
    scale_value,
    threshold,
    causal,
    keep_sink,
    keep_recent,
    row_sparse,
):
    _check_common("sparse_block_estimate", input_layout, num_heads, num_key_value_heads, query, key)
    if actual_seq_lengths is not None or actual_seq_lengths_kv is not None:
        raise RuntimeError("test double: actual_seq_lengths are not modelled")
    if sparse_size % stride:
        raise RuntimeError("attentions.sparse_block_estimate: sparse_size % stride != 0")
    q = _bnsd(query, input_layout, num_heads).float()
    k = _bnsd(key, input_layout, num_key_value_heads).float()
    batch, heads, seq, dim = q.shape
    group = heads // num_key_value_heads
    n_blocks = math.ceil(seq / sparse_size)
    width = math.ceil(n_blocks / 32) * 32
    cells = sparse_size // stride
    rows = math.ceil(seq / stride)
    pad = rows * stride - seq
    mask = torch.zeros(batch, heads, n_blocks, width, dtype=torch.int8)
    for b in range(batch):
        for n in range(heads):
            qp = torch.cat([q[b, n], q.new_zeros(pad, dim)])
            kp = torch.cat([k[b, n // group], k.new_zeros(pad, dim)])
            # Queries reversed inside each group of `stride`, keys in order.
            qr = qp.view(rows, stride, dim).flip(1).reshape(rows, stride * dim)
            kr = kp.view(rows, stride * dim)
            s = (qr @ kr.T) * scale_value
            for i in range(rows):
                if causal:
                    s[i, (i // cells + 1) * cells :] = float("-inf")
            p = torch.softmax(s, dim=-1)
            cell = torch.arange(rows) // cells
            block = torch.zeros(n_blocks, n_blocks)
            index = (cell[:, None].expand(rows, rows), cell[None, :].expand(rows, rows))
            block.index_put_(index, p, accumulate=True)
            for r in range(n_blocks):
                mask[b, n, r, :n_blocks] = _select_row(
                    block[r], r, n_blocks, causal, threshold, row_sparse, keep_sink, keep_recent
                )
    return mask, mask.sum(-1, dtype=torch.int32)


def _select_row(scores, r, n_blocks, causal, threshold, row_sparse, keep_sink, keep_recent):
    n_cand = min(r + 1, n_blocks) if causal else n_blocks
    keep = torch.zeros(n_blocks, dtype=torch.int8)
    if causal and n_cand <= 2:
        keep[:n_cand] = 1
        return keep
    forced = set()
    if keep_sink:
        forced.add(0)
    if keep_recent:
        forced.add(n_cand - 1)
    scored = [j for j in range(n_cand) if j not in forced]
    values = sorted((float(scores[j]) for j in scored), reverse=True)
    if threshold >= 1 or not values:
        cutoff, selected = 0.0, n_cand
    else:
        total, run, idx = sum(values), 0.0, len(values) - 1
        for i, val in enumerate(values):
            run += val
            if run >= threshold * total:
                idx = i
                break
        cutoff, selected = values[idx], idx + 1 + len(forced)
    if selected > n_cand * row_sparse and n_cand >= 10:
        top_k = max(1, int(n_cand * row_sparse))
        cutoff = values[top_k - 1] if top_k <= len(values) else 0.0
    for j in scored:
        if float(scores[j]) > cutoff - 1e-5:
            keep[j] = 1
    for j in forced:
        keep[j] = 1
    return keep


_ATTENTION_SCHEMA = (
    "(Tensor query, Tensor key, Tensor value, Tensor sparse_mask, Tensor sparse_count_table, "
    "str input_layout='BNSD', int sparse_size=128, int num_heads=1, int num_key_value_heads=1, "
    "float scale_value=1, bool causal=True, int inner_precise=1, int pre_tokens=214748647, "
    "int next_tokens=0, int[]? actual_seq_lengths=None, int[]? actual_seq_lengths_kv=None) "
    "-> Tensor"
)


def _ada_block_sparse_attention(
    query,
    key,
    value,
    sparse_mask,
    sparse_count_table,
    input_layout,
    sparse_size,
    num_heads,
    num_key_value_heads,
    scale_value,
    causal,
    inner_precise,
    pre_tokens,
    next_tokens,
    actual_seq_lengths,
    actual_seq_lengths_kv,
):
    op = "ada_block_sparse_attention"
    if input_layout == "TND":
        raise RuntimeError(f"attentions.{op}: layout TND rejected")
    _check_common(op, input_layout, num_heads, num_key_value_heads, query, key)
    if sparse_mask.dtype not in (torch.int8, torch.bool):
        raise RuntimeError(f"attentions.{op}: sparse_mask dtype {sparse_mask.dtype}")
    if sparse_count_table.dtype != torch.int32:
        raise RuntimeError(f"attentions.{op}: sparse_count_table dtype {sparse_count_table.dtype}")
    if inner_precise not in (0, 1):
        raise RuntimeError(f"attentions.{op}: inner_precise {inner_precise}")
    q = _bnsd(query, input_layout, num_heads).float()
    k = _bnsd(key, input_layout, num_key_value_heads).float()
    v = _bnsd(value, input_layout, num_key_value_heads).float()
    if num_heads > 256 or q.shape[3] > 512:
        raise RuntimeError(f"attentions.{op}: numHeads <= 256 and D <= 512, got {list(q.shape)}")
    if v.shape[3] != q.shape[3]:
        raise RuntimeError(f"attentions.{op}: value head dim {v.shape[3]} != query's {q.shape[3]}")
    fp16_scores = query.dtype == torch.float16 and inner_precise & 1
    batch, heads, seq, _ = q.shape
    kv_len = k.shape[2]
    group = heads // num_key_value_heads
    q_blocks = math.ceil(seq / sparse_size)
    kv_blocks = math.ceil(kv_len / sparse_size)
    if tuple(sparse_mask.shape[:3]) != (batch, heads, q_blocks) or sparse_mask.shape[3] < kv_blocks:
        raise RuntimeError(f"attentions.{op}: sparse_mask shape {list(sparse_mask.shape)}")
    if not torch.equal(sparse_mask.to(torch.int32).sum(-1, dtype=torch.int32), sparse_count_table):
        raise RuntimeError(f"attentions.{op}: sparse_count_table is not the mask's row sums")
    out = torch.zeros(batch, heads, seq, v.shape[3])
    pos_q = torch.arange(seq)[:, None]
    pos_k = torch.arange(kv_len)[None, :]
    for b in range(batch):
        for n in range(heads):
            allowed = torch.zeros(seq, kv_len, dtype=torch.bool)
            for r in range(q_blocks):
                # The kernel turns the row into block ids and uses the first `count`.
                ids = sparse_mask[b, n, r].nonzero().flatten()[: int(sparse_count_table[b, n, r])]
                rows = slice(r * sparse_size, (r + 1) * sparse_size)
                for j in ids.tolist():
                    allowed[rows, j * sparse_size : (j + 1) * sparse_size] = True
            if causal:
                allowed &= (pos_k <= pos_q + next_tokens) & (pos_k >= pos_q - pre_tokens)
            s = q[b, n] @ k[b, n // group].T
            if fp16_scores:  # high performance: the first matmul's output and softmax in fp16
                s = (s.half() * torch.tensor(scale_value).half()).float()
            else:
                s = s * scale_value
            s = s.masked_fill(~allowed, float("-inf"))
            p = torch.softmax(s, dim=-1).nan_to_num(0.0)
            if fp16_scores:
                p = p.half().float()
            out[b, n] = p @ v[b, n // group]
    if input_layout == "BNSD":
        return out.to(query.dtype)
    out = out.transpose(1, 2).to(query.dtype)
    return out.reshape(query.shape).contiguous()


fake_op("ada_block_sparse_attention", _ATTENTION_SCHEMA)(_ada_block_sparse_attention)
fake_op("block_sparse_attention", _ATTENTION_SCHEMA)(_ada_block_sparse_attention)
