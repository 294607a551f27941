"""The permuted mode against the video order's block oracle on scattered semantic attention.

``PYTHONPATH=src python benchmarks/cpu/probes/permute_scattered.py``

:func:`ditops.bench.video_attention.scattered_attention` at Wan's 21 x 16 x 24 tokens
(8064, 12 heads of 128, fp32, every 4th head local), the first frame's 3 blocks forced,
density 0.25 (sparsity 0.75), method ``sampled``: the relative L2 error of the output
against dense attention, per head and overall, of ``BlockSparseAttention`` in the video
order and with ``permute=True``, and of the video order's per-row oracle mask (the best
mask with as many blocks per row: the unpermuted block oracle). ``ditops bench masks
--size scattered`` measures the same and more (both orders' oracles, mass targets).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ditops.bench.masks import MaskReference
from ditops.bench.video_attention import scattered_attention
from ditops.layers.sparse_attention import BlockSparseAttention


def main() -> None:
    shape = (21, 16, 24)
    q, k, v = scattered_attention(*shape, heads=12)
    with torch.inference_mode():
        dense = F.scaled_dot_product_attention(q, k, v)

        def err(o: torch.Tensor) -> torch.Tensor:
            return ((o - dense).norm(dim=(-1, -2)) / dense.norm(dim=(-1, -2)))[0]

        out = {}
        for permute in (False, True):
            layer = BlockSparseAttention(sparsity=0.75, permute=permute, dense_blocks=3)
            o = layer(q, k, v, step=1)
            out[permute] = (o, layer._last_run[0], layer._last_permutation)
            e = err(o)
            print(f"permute={permute}: per head {[round(x, 3) for x in e.tolist()]}")
            print(f"  overall rel err {float((o - dense).norm() / dense.norm()):.4f}")
            if permute:
                print(f"  heads clustered: {out[True][2].clustered.int().tolist()}")
    ref = MaskReference.of(q, k, v, shape)
    plain = ref.quality(out[False][1])
    print(
        f"video order: rel err {plain.rel_err:.4f}, its per-row oracle {plain.row_oracle_err:.4f}"
    )
    perm_err = float((out[True][0] - dense).norm() / dense.norm())
    print(f"permuted / unpermuted oracle: {perm_err / plain.row_oracle_err:.2f} (target <= 0.7)")


if __name__ == "__main__":
    main()
