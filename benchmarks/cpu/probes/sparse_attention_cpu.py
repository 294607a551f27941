"""Block-sparse attention on CPU: dense SDPA vs the gathered-SDPA path vs FlexAttention.

Every variant is timed interleaved with dense SDPA on the same inputs in one process
(dense, then each variant, repeated), and the table gives medians of wall time and of
process CPU time (the machine is shared: CPU time moves less with other people's
load) and ratios to dense SDPA. ``of ideal`` is ``speedup x density`` (1.0 when the
sparse kernel is exactly as efficient per computed block as dense SDPA); ``err`` is the
largest difference to ``forward_native`` over the first two heads, in units of
``max|v|`` (the op's ``fast`` contract: 8e-3 for bf16).

Masks (``[1, H, S, 128]``, block 128): ``random`` keeps ``round(keep * KVb)`` random
blocks per row; ``video`` keeps as many top blocks of the estimator's scores on the
video-like q/k of ``ditops.bench.attention`` (what ``ditops bench attention`` times);
``est`` is ``estimate_block_mask(keep_ratio=keep)`` itself (sink, recent and ties make
it a little denser).

    PYTHONPATH=src python benchmarks/cpu/probes/sparse_attention_cpu.py            # main
    PYTHONPATH=src python benchmarks/cpu/probes/sparse_attention_cpu.py --flex-options
    PYTHONPATH=src python benchmarks/cpu/probes/sparse_attention_cpu.py --seq 7777 \\
        --layout BSND --keeps 0.25                                                # odd
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import ditops.kernels.cpu.block_sparse_attention as kernel
from ditops.attention.block_mask import (
    density_stats,
    num_blocks,
    row_counts,
    to_flex_block_mask,
)
from ditops.attention.estimate import block_scores
from ditops.attention.layout import to_bnsd
from ditops.bench.attention import video_qk
from ditops.kernels.cpu.block_sparse_attention import gathered_block_sparse_attention
from ditops.kernels.flex_attention import flex_block_sparse_attention
from ditops.ops.block_sparse_attention import block_sparse_attention
from ditops.ops.estimate_block_mask import estimate_block_mask

BLOCK = 128


def machine() -> str:
    flags = open("/proc/cpuinfo").read()
    isa = [f for f in ("avx512f", "avx512_bf16", "amx_tile") if f" {f}" in flags]
    model = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((ln.split(":", 1)[1].strip() for ln in model.splitlines()
                 if ln.startswith("Model name")), platform.processor())  # fmt: skip
    return (
        f"{name}, {os.cpu_count()} cpus, {'/'.join(isa) or 'AVX2 only, no AMX'}, "
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"load {os.getloadavg()[0]:.1f}"
    )


def inputs(heads: int, seq: int, dim: int, dtype: torch.dtype):
    """Video-like q/k (the bench's), random v, BNSD."""
    frames = -(-seq // 1024)
    q, k = video_qk(frames, 32, 32, heads=heads, dim=dim, dtype=dtype)
    q, k = q[:, :, :seq].contiguous(), k[:, :, :seq].contiguous()
    v = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    return q, k, v


def top_blocks_mask(scores: torch.Tensor, keep: float) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 mask keeping exactly ``max(1, round(keep * KVb))`` top-scoring blocks per row."""
    n = max(1, round(keep * scores.shape[-1]))
    mask = torch.zeros(scores.shape, dtype=torch.int8, device=scores.device)
    mask.scatter_(-1, scores.topk(n, dim=-1).indices, 1)
    return mask, row_counts(mask)


def masks(q: torch.Tensor, k: torch.Tensor, keep: float, kinds: list[str]):
    seq, kvb = q.shape[2], num_blocks(k.shape[2], BLOCK)
    out = {}
    gen = torch.Generator().manual_seed(2)
    for kind in kinds:
        if kind == "random":
            scores = torch.rand(*q.shape[:2], num_blocks(seq, BLOCK), kvb, generator=gen)
            out[kind] = top_blocks_mask(scores, keep)
        elif kind == "video":
            scores = block_scores(q, k, block_size=BLOCK, stride=8,
                                  score_scale=q.shape[3] ** -0.5 / 8, causal=False)  # fmt: skip
            out[kind] = top_blocks_mask(scores, keep)
        elif kind == "est":
            out[kind] = estimate_block_mask(q, k, keep_ratio=keep)
    return out


def full_block_mask(mask, counts, *, q_len, kv_len, causal):
    """The same blocks, passed as FlexAttention *full* blocks (diagonal partial if causal)."""
    from torch.nn.attention.flex_attention import BlockMask

    kvb = num_blocks(kv_len, BLOCK)
    m = mask[..., :kvb].to(torch.int8)
    partial = torch.zeros_like(m)
    if causal:
        qb = m.shape[2]
        r = torch.arange(qb)[:, None]
        j = torch.arange(kvb)[None, :]
        partial = m * (j == r)
        m = m * (j < r)
    order = lambda x: torch.argsort(x, dim=-1, descending=True, stable=True).to(torch.int32)  # noqa: E731
    return BlockMask.from_kv_blocks(
        row_counts(partial), order(partial), row_counts(m), order(m), BLOCK_SIZE=BLOCK,
        mask_mod=(lambda b, h, qi, ki: qi >= ki) if causal else None,
        seq_lengths=(q_len, kv_len), compute_q_blocks=False,
    )  # fmt: skip


def time_all(variants: dict[str, Callable[[], object]], reps: int):
    walls: dict[str, list[float]] = {n: [] for n in variants}
    cpus: dict[str, list[float]] = {n: [] for n in variants}
    with torch.inference_mode():
        for f in variants.values():
            f()  # warm up (compiles FlexAttention)
        for _ in range(reps):
            for name, f in variants.items():
                w, c = time.perf_counter(), time.process_time()
                f()
                walls[name].append(time.perf_counter() - w)
                cpus[name].append(time.process_time() - c)
    return {n: (statistics.median(walls[n]), statistics.median(cpus[n])) for n in variants}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--layout", default="BNSD", choices=("BNSD", "BSND"))
    p.add_argument("--keeps", default="0.5,0.25,0.1")
    p.add_argument("--masks", default="random,video")
    p.add_argument("--no-flex", action="store_true", help="skip FlexAttention (compiles)")
    p.add_argument("--flex-options", action="store_true",
                   help="FlexAttention variants at the first keep, random mask")  # fmt: skip
    p.add_argument("--causal", action="store_true")
    p.add_argument("--no-pairs", action="store_true",
                   help="also time the gathered path without query-block pairs")  # fmt: skip
    p.add_argument("--pair-shares", default="",
                   help="also time these PAIR_MIN_SHARED values, e.g. 0.75,0.9")  # fmt: skip
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    keeps = [float(x) for x in args.keeps.split(",")]
    args.pair_shares = [float(x) for x in args.pair_shares.split(",") if x]
    kinds = args.masks.split(",")
    causal = args.causal
    q, k, v = inputs(args.heads, args.seq, args.dim, dtype)
    seq, scale = q.shape[2], args.dim**-0.5
    lay = (lambda t: t.transpose(1, 2).contiguous()) if args.layout == "BSND" else (lambda t: t)
    ql, kl, vl = lay(q), lay(k), lay(v)
    print(f"# {machine()}")
    print(f"# [1, {args.heads}, {seq}, {args.dim}] {args.dtype} {args.layout}"
          f"{' causal' if causal else ''}, block {BLOCK}, reps {args.reps}")  # fmt: skip

    qv, kv, vv = (to_bnsd(t, args.layout) for t in (ql, kl, vl))

    def dense():
        return F.scaled_dot_product_attention(qv, kv, vv, is_causal=causal)

    def gathered(m, pairs=True, share=None):
        def run():
            kept = kernel.PAIR_QUERY_BLOCKS, kernel.PAIR_MIN_SHARED
            kernel.PAIR_QUERY_BLOCKS = pairs
            kernel.PAIR_MIN_SHARED = kept[1] if share is None else share
            try:
                return gathered_block_sparse_attention(
                    qv, kv, vv, m, scale, causal, BLOCK, args.layout == "BSND"
                )
            finally:
                kernel.PAIR_QUERY_BLOCKS, kernel.PAIR_MIN_SHARED = kept

        return run

    def flex(m, c, *, full=False, skip=True, fp32=False):
        bm = (full_block_mask(m, c, q_len=seq, kv_len=seq, causal=causal) if full
              else to_flex_block_mask(m, c, q_len=seq, kv_len=seq, block_size=BLOCK,
                                      causal=causal))  # fmt: skip
        a = [t.float() for t in (q, k, v)] if fp32 else [q, k, v]
        if not skip:
            from torch.nn.attention.flex_attention import flex_attention

            compiled = torch.compile(flex_attention, dynamic=False, fullgraph=True)
            return lambda: compiled(*a, block_mask=bm, scale=scale)
        return lambda: flex_block_sparse_attention(*a, bm, scale=scale, needs_mask_mod=causal)

    variants: dict[str, Callable[[], object]] = {"dense SDPA": dense}
    info: dict[str, tuple[float, float]] = {}
    for keep in keeps:
        for kind, (m, c) in masks(q, k, keep, kinds).items():
            density = density_stats(m, q_len=seq, kv_len=seq, block_size=BLOCK, causal=causal)
            tag = f"{kind} keep={keep}"
            ref = block_sparse_attention.op.forward_native(
                q[:, :2], k[:, :2], v[:, :2], m[:, :2], c[:, :2], layout="BNSD", scale=scale,
                causal=causal, block_size=BLOCK,
            )  # fmt: skip
            vmax = float(v[:, :2].abs().max())

            def err(f, ref=ref, vmax=vmax):
                with torch.inference_mode():
                    out = f()
                if args.layout == "BSND" and out.shape[1] == seq:
                    out = out.transpose(1, 2)
                return float((out[:, :2].float() - ref.float()).abs().max()) / vmax

            group = {f"gathered {tag}": gathered(m)}
            if args.no_pairs:
                group[f"gathered, no pairs {tag}"] = gathered(m, pairs=False)
            for share in args.pair_shares:
                group[f"gathered, pairs >= {share} {tag}"] = gathered(m, share=share)
            if not args.no_flex and (not args.flex_options or keep == keeps[0]):
                group[f"flex {tag}"] = flex(m, c)
            if args.flex_options and keep == keeps[0] and kind == kinds[0]:
                group[f"flex full blocks {tag}"] = flex(m, c, full=True)
                group[f"flex no SKIP_MASK_SCORE {tag}"] = flex(m, c, skip=False)
                group[f"flex fp32 inputs {tag}"] = flex(m, c, fp32=True)
            for name, f in group.items():
                info[name] = (density.density, err(f))
            variants.update(group)
    res = time_all(variants, args.reps)
    dw, dc = res["dense SDPA"]
    print(f"{'variant':<42} {'density':>7} {'wall s':>7} {'x dense':>7} {'of ideal':>8} "
          f"{'cpu s':>7} {'x dense':>7} {'of ideal':>8} {'err':>8}")  # fmt: skip
    for name, (w, c) in res.items():
        dens, e = info.get(name, (1.0, 0.0))
        print(f"{name:<42} {dens:7.3f} {w:7.3f} {dw / w:7.2f} {dw / w * dens:8.2f} "
              f"{c:7.3f} {dc / c:7.2f} {dc / c * dens:8.2f} {e:8.1e}")  # fmt: skip
    print(f"# load at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
