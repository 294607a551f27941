"""Dense SDPA vs estimate + block-sparse attention at [1, 8192, 12, 128] bf16 (BSND), CPU."""

import logging
import time

import torch

from ditops.layers.sparse_attention import dense_attention
from ditops.ops.block_sparse_attention import block_sparse_attention
from ditops.ops.estimate_block_mask import estimate_block_mask

logging.basicConfig(level=logging.INFO)

torch.manual_seed(0)
q, k, v = (torch.randn(1, 8192, 12, 128).bfloat16() for _ in range(3))


def tm(f, n=3):
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return [round(x, 3) for x in ts]


with torch.inference_mode():
    print("dense BSND", tm(lambda: dense_attention(q, k, v, layout="BSND")))
    m, c = estimate_block_mask(q, k, layout="BSND", keep_ratio=0.25, dense_blocks=2)
    print("density", m.float().mean().item())
    print(
        "estimate",
        tm(lambda: estimate_block_mask(q, k, layout="BSND", keep_ratio=0.25, dense_blocks=2)),
    )
    print("sparse", tm(lambda: block_sparse_attention(q, k, v, m, c, layout="BSND")))
    qb, kb, vb = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    print("sparse BNSD contiguous", tm(lambda: block_sparse_attention(qb, kb, vb, m, c)))
