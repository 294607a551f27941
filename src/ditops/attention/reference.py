"""The meaning of block-sparse attention, in plain PyTorch, with bounded memory.

For every query position ``i`` in query block ``qb`` (head ``n``, batch ``b``), the
keys it attends to are the positions of the key blocks selected in
``mask[b, n, qb]`` (and, under ``causal``, only keys ``j <= i``: top-left aligned, so
the diagonal block is lower-triangular). Softmax runs over exactly those keys; a
query with none outputs zeros. GQA: query head ``n`` uses key/value head
``n // (Nq / Nkv)``.

The computation is fp32, chunked over heads and query blocks so that no more than a
few million scores are alive at once: at 32k tokens there is never an ``S x S``
matrix, only ``[heads in chunk, rows in chunk, S]`` slices of it.
"""

from __future__ import annotations

import torch

from ditops.attention.block_mask import num_blocks
from ditops.attention.layout import plan_chunks, to_bnsd


def block_sparse_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    *,
    layout: str = "BNSD",
    scale: float | None = None,
    causal: bool = False,
    block_size: int = 128,
) -> torch.Tensor:
    """Block-sparse attention, the reference (see the module docstring).

    Args:
        q, k, v: ``[B, N, S, D]`` (``BNSD``) or ``[B, S, N, D]`` (``BSND``); k and v
            have ``Nkv`` heads dividing ``Nq``.
        mask: 0/1 ``[B, Nq, Qb, >=KVb]`` (counts, equal to its row sums, are not needed).
        scale: softmax scale, default ``D ** -0.5``.

    Returns:
        The output in the query's layout and dtype, ``v``'s head dim.
    """
    qb, kb, vb = to_bnsd(q, layout), to_bnsd(k, layout), to_bnsd(v, layout)
    batch, heads, q_len, dim = (int(s) for s in qb.shape)
    kv_heads, kv_len, v_dim = int(kb.shape[1]), int(kb.shape[2]), int(vb.shape[3])
    group = heads // kv_heads
    if scale is None:
        scale = dim**-0.5
    kv_blocks = num_blocks(kv_len, block_size)
    if layout == "BNSD":
        out = torch.empty(batch, heads, q_len, v_dim, dtype=q.dtype, device=q.device)
        out_bnsd = out
    else:
        out = torch.empty(batch, q_len, heads, v_dim, dtype=q.dtype, device=q.device)
        out_bnsd = out.transpose(1, 2)
    if q_len == 0 or kv_len == 0:
        return out.zero_()  # no keys: every query outputs zeros
    dev = q.device
    col_block = torch.arange(kv_len, device=dev) // block_size
    col_pos = torch.arange(kv_len, device=dev)
    keep = mask[..., :kv_blocks].to(torch.bool)

    head_chunk, row_chunk = plan_chunks(heads, q_len, kv_len, block_size)
    for b in range(batch):
        for h0 in range(0, heads, head_chunk):
            h1 = min(heads, h0 + head_chunk)
            kv_idx = torch.arange(h0, h1, device=dev) // group
            kc = kb[b].index_select(0, kv_idx).float()
            vc = vb[b].index_select(0, kv_idx).float()
            for r0 in range(0, q_len, row_chunk):
                r1 = min(q_len, r0 + row_chunk)
                rows = torch.arange(r0, r1, device=dev)
                s = torch.matmul(qb[b, h0:h1, r0:r1].float(), kc.transpose(-1, -2)) * scale
                allowed = keep[b, h0:h1].index_select(1, rows // block_size)
                allowed = allowed.index_select(2, col_block)
                if causal:
                    allowed = allowed & (col_pos[None, :] <= rows[:, None])
                s = s.masked_fill(~allowed, float("-inf"))
                top = s.amax(-1, keepdim=True)
                # A row with no allowed key: exp(-inf - 0) = 0 everywhere, output 0.
                top = top.masked_fill(top == float("-inf"), 0.0)
                p = (s - top).exp()
                denom = p.sum(-1, keepdim=True)
                denom = denom.masked_fill(denom == 0, 1.0)
                o = torch.matmul(p, vc) / denom
                out_bnsd[b, h0:h1, r0:r1] = o.to(q.dtype)
    return out
