"""CPU block-sparse attention kernels against dense SDPA on the estimator's masks (issue 19).

Inputs: the video-like generator's q/k/v in Wan's geometry (21 x 16 x 24 latent = 8064
tokens, 12 heads of 128); masks: the layer's own estimate (``BlockSparseConfig``'s
default method) at keep 0.25 and 0.5 with the first frame forced dense. Variants, timed
interleaved in one process (dense, then each kernel, repeated), medians of wall time:

* ``dense``: ``F.scaled_dot_product_attention`` on the same q/k/v;
* ``gathered``: the selected key blocks copied together, SDPA on them
  (:mod:`ditops.kernels.cpu.block_sparse_attention`);
* ``flex``: compiled FlexAttention with the same blocks (:mod:`ditops.kernels.flex_attention`;
  compiled once per shape before timing, the compile time is printed apart);
* ``op``: ``ditops.block_sparse_attention`` as a user calls it, under the process's
  ``DITOPS_TUNE`` (``on``: its first call times both paths; the choice is printed).

``eff`` is ``speedup x density`` (1.0 = as fast per computed block as dense SDPA; the
issue's target is 0.85); ``err`` the largest difference to ``forward_native`` in units
of ``max|v|`` (the op's ``fast`` contract: 8e-3 bf16, 1e-5 fp32).

    PYTHONPATH=src python benchmarks/cpu/probes/sparse_kernel_wan.py [--dtypes bfloat16,float32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ditops.attention import BlockSparseConfig
from ditops.attention.block_mask import density_stats, to_flex_block_mask
from ditops.bench.harness import interleaved
from ditops.bench.video_attention import SHAPES, video_attention
from ditops.kernels.cpu.block_sparse_attention import gathered_block_sparse_attention
from ditops.kernels.flex_attention import flex_block_sparse_attention
from ditops.layers.sparse_attention import BlockSparseAttention
from ditops.ops.block_sparse_attention import block_sparse_attention

BLOCK = 128


def kernels(q, k, v, mask, counts) -> dict[str, Callable[[], torch.Tensor]]:
    """The variants besides dense (see the module docstring)."""
    scale = q.shape[-1] ** -0.5
    seq = q.shape[2]
    flex_mask = to_flex_block_mask(mask, counts, q_len=seq, kv_len=seq, block_size=BLOCK,
                                   causal=False)  # fmt: skip
    return {
        "gathered": lambda: gathered_block_sparse_attention(
            q, k, v, mask, scale, False, BLOCK, False
        ),
        "flex": lambda: flex_block_sparse_attention(
            q, k, v, flex_mask, scale=scale, needs_mask_mod=False
        ),
        "op": lambda: block_sparse_attention(q, k, v, mask, counts),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--keeps", default="0.25,0.5")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--variants", default="gathered,flex")
    args = p.parse_args()
    frames, h, w = SHAPES["wan"]
    dense_blocks = -(-(h * w) // BLOCK)
    print(
        f"# torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, "
        f"{torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}; "
        f"Wan {frames}x{h}x{w}, first frame = {dense_blocks} blocks forced"
    )
    print(f"{'dtype':9} {'keep':>5} {'density':>7} {'variant':9} {'ms':>8} {'x dense':>8} "
          f"{'eff':>5} {'err':>8}")  # fmt: skip
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        q, k, v = video_attention(frames, h, w, dtype=dtype)
        with torch.inference_mode():
            for keep in (float(x) for x in args.keeps.split(",")):
                layer = BlockSparseAttention(BlockSparseConfig(sparsity=1 - keep),
                                             dense_blocks=dense_blocks)  # fmt: skip
                mask, counts = layer._estimate(q, k, layout="BNSD", scale=None,
                                               dense_blocks=dense_blocks)  # fmt: skip
                density = density_stats(mask, q_len=q.shape[2], kv_len=k.shape[2],
                                        block_size=BLOCK).density  # fmt: skip
                two = [t[:, :2] for t in (q, k, v, mask, counts)]
                ref = block_sparse_attention.op.forward_native(*two)
                vmax = float(v.abs().max())
                every = {"dense": lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v)}
                kern = kernels(q, k, v, mask, counts)
                every.update({n: kern[n] for n in args.variants.split(",")})
                errs: dict[str, float] = {}
                for name, f in every.items():
                    t0 = time.perf_counter()
                    out = f()
                    first = time.perf_counter() - t0
                    if name != "dense":
                        errs[name] = float((out[:, :2].float() - ref.float()).abs().max()) / vmax
                        print(f"# {dtype_name} keep {keep} {name}: first call {first:.1f} s")
                times = interleaved(every, args.reps)
                d = statistics.median(times["dense"])
                for name, ts in times.items():
                    t = statistics.median(ts)
                    x = d / t
                    eff = x * density if name != "dense" else 1.0
                    err = f"{errs[name]:.1e}" if name in errs else "-"
                    print(f"{dtype_name:9} {keep:5.2f} {density:7.3f} {name:9} {t * 1e3:8.1f} "
                          f"{x:8.2f} {eff:5.2f} {err:>8}", flush=True)  # fmt: skip
    from ditops.bench.load import header
    from ditops.core import tune

    print("# " + "\n# ".join(header()))
    print("# tuned choices:\n# " + "\n# ".join(tune.describe(tune.choices())))
    print(f"# load at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
