"""Shared helpers for the block-sparse attention tests: masks and a dense oracle."""

from __future__ import annotations

import math

import torch


def random_mask(
    batch: int,
    heads: int,
    q_blocks: int,
    kv_blocks: int,
    density: float = 0.4,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random int8 block mask with one empty row and one full row per head, and counts."""
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.rand(batch, heads, q_blocks, kv_blocks, generator=gen) < density).to(torch.int8)
    mask[:, :, 0] = 0  # an empty row: its queries output zeros
    mask[:, :, -1] = 1  # a full row: dense attention for those queries
    return mask, mask.sum(-1, dtype=torch.int32)


def dense_oracle(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    *,
    block_size: int,
    causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """float64 masked softmax attention over a full S x S token mask (small inputs only).

    BNSD in, BNSD out, the query's dtype.
    """
    heads, kv_heads = q.shape[1], k.shape[1]
    q_len, kv_len = q.shape[2], k.shape[2]
    kd = k.double().repeat_interleave(heads // kv_heads, dim=1)
    vd = v.double().repeat_interleave(heads // kv_heads, dim=1)
    kv_blocks = math.ceil(kv_len / block_size)
    tokens = mask[..., :kv_blocks].bool()
    tokens = tokens.repeat_interleave(block_size, -2).repeat_interleave(block_size, -1)
    tokens = tokens[..., :q_len, :kv_len]
    if causal:
        tokens = tokens & torch.ones(q_len, kv_len, dtype=torch.bool).tril()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = torch.empty(*q.shape[:3], v.shape[-1], dtype=torch.float64)
    for n in range(heads):  # one head at a time: 4097^2 float64 scores are 134 MB
        s = (q[:, n].double() @ kd[:, n].transpose(-1, -2)) * scale
        p = torch.softmax(s.masked_fill(~tokens[:, n], float("-inf")), dim=-1).nan_to_num(0.0)
        out[:, n] = p @ vd[:, n]
    return out.to(q.dtype)
