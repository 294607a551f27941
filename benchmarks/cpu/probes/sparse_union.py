"""Union-of-neighbours block-sparse attention on CPU, against the gathered kernel (issue 19).

Idea: serve a group of neighbouring query blocks of one head with ONE SDPA call over the
union of their selected key blocks, with an additive ``-inf`` mask (in the input dtype:
a bool mask is converted by ATen and costs 1.5-2x, a same-dtype float one ~10%) for the
(row block, key block) pairs the mask does not select. Large query tiles (512-1024 rows)
for more FLOPs (the union is larger than one row's selection).

Variants: fixed groups of G = 2, 4, 6, 8 query blocks, and ``greedy``: extend a group of
neighbours (up to 8) while ``union * rows <= ALPHA * sum(selections)``. Compared in the
same run with ``gathered_block_sparse_attention`` (today's kernel) and dense SDPA, on the
estimator's masks (``sampled``, first frame forced dense) for Wan's 21 x 16 x 24 latent
(bf16/fp32 ``[1, 12, 8064, 128]``). Interleaved rounds, min and median.

Probe only: BNSD, no GQA, not causal, whole blocks (8064 = 63 x 128).

    python benchmarks/cpu/probes/sparse_union.py [--rounds 3] [--mask-only]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import ditops
from ditops.bench.harness import interleaved
from ditops.bench.video_attention import video_attention
from ditops.kernels.cpu.block_sparse_attention import gathered_block_sparse_attention

BLOCK = 128


def plan_groups(sel: torch.Tensor, size: int | None, alpha: float) -> list[tuple[int, int]]:
    """[start, end) query-block groups of one head's ``[Qb, Kb]`` selection."""
    qb = sel.shape[0]
    if size is not None:
        return [(s, min(s + size, qb)) for s in range(0, qb, size)]
    counts = sel.sum(-1).tolist()
    groups, s = [], 0
    while s < qb:
        e, union, total = s + 1, sel[s].clone(), counts[s]
        while e < qb and e - s < 8:
            u = union | sel[e]
            if int(u.sum()) * (e + 1 - s) > alpha * (total + counts[e]):
                break
            union, total, e = u, total + counts[e], e + 1
        groups.append((s, e))
        s = e
    return groups


def union_attention(q, k, v, mask, scale, plans):
    """Block-sparse attention, one SDPA call per planned group over its union of blocks."""
    _, heads, seq, dim = q.shape
    kb = seq // BLOCK
    out = torch.empty_like(q)
    kblocks = k[0].reshape(heads, kb, BLOCK * dim)
    vblocks = v[0].reshape(heads, kb, BLOCK * dim)
    neg = torch.tensor(float("-inf"), dtype=q.dtype)
    zero = torch.tensor(0.0, dtype=q.dtype)
    for n in range(heads):
        sel = mask[0, n]
        for s, e in plans[n]:
            part = sel[s:e]
            ids = part.any(0).nonzero().flatten()
            rows = slice(s * BLOCK, e * BLOCK)
            if ids.numel() == 0:
                out[0, n, rows] = 0
                continue
            u = ids.numel()
            kk = kblocks[n].index_select(0, ids).view(1, 1, u * BLOCK, dim)
            vv = vblocks[n].index_select(0, ids).view(1, 1, u * BLOCK, dim)
            chosen = part[:, ids]
            attn_mask = None
            if not bool(chosen.all()):
                m = torch.where(chosen, zero, neg)  # [g, u]
                g = e - s
                attn_mask = (
                    m[:, None, :, None].expand(g, BLOCK, u, BLOCK).reshape(g * BLOCK, u * BLOCK)
                )
            o = F.scaled_dot_product_attention(
                q[:, n : n + 1, rows], kk, vv, attn_mask=attn_mask, scale=scale
            )
            out[0, n, rows] = o[0, 0]
            empty = (part.sum(-1) == 0).nonzero().flatten().tolist()
            for r in empty:  # rows with no block: zeros, as the meaning
                out[0, n, (s + r) * BLOCK : (s + r + 1) * BLOCK] = 0
    return out


def variants(q, k, v, mask, keep, alphas):
    """The runs to time (name -> call) and their union / selection ratios."""
    scale = q.shape[-1] ** -0.5
    sel_total = int(mask.sum())
    runs = {
        "dense": lambda: F.scaled_dot_product_attention(q, k, v),
        "gathered": lambda: gathered_block_sparse_attention(
            q, k, v, mask.to(torch.int8), scale, False, BLOCK, False
        ),
    }
    ratios = {"dense": 1 / keep, "gathered": 1.0}
    kinds = [(f"G={g}", g, 0.0) for g in (2, 4, 6, 8)]
    kinds += [(f"greedy{a}", None, a) for a in alphas]
    for name, g, alpha in kinds:
        plans = [plan_groups(mask[0, n], g, alpha) for n in range(12)]
        union = sum(
            int(mask[0, n, s:e].any(0).sum()) * (e - s) for n in range(12) for s, e in plans[n]
        )
        ratios[name] = union / sel_total
        runs[name] = lambda plans=plans: union_attention(q, k, v, mask, scale, plans)
    return runs, ratios


def mask_cost(dtype: torch.dtype, rounds: int) -> None:
    """GF/s of one SDPA call, [1, 1, M, 128] queries on 2048 keys: no mask, a bool one,
    an additive one in ``dtype`` (60% of the blocks kept)."""
    for m in (128, 256, 512, 1024):
        q = torch.randn(1, 1, m, 128, dtype=dtype)
        k, v = torch.randn(1, 1, 2048, 128, dtype=dtype), torch.randn(1, 1, 2048, 128, dtype=dtype)
        keep = (torch.rand(m // BLOCK, 16) < 0.6).repeat_interleave(BLOCK, 0)
        keep = keep.repeat_interleave(BLOCK, 1)
        add = torch.zeros(m, 2048, dtype=dtype).masked_fill(~keep, float("-inf"))
        rates = []
        for mask in (None, keep, add):
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            ts = []
            for _ in range(rounds + 2):
                t0 = time.perf_counter()
                F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                ts.append(time.perf_counter() - t0)
            rates.append(4 * m * 2048 * 128 / min(ts) / 1e9)
        print(
            f"{str(dtype)[6:]:>9} M={m:<5} GF/s: no mask {rates[0]:.0f}, bool {rates[1]:.0f}, "
            f"additive {rates[2]:.0f}"
        )


def masked_tiles(dtype: torch.dtype, rounds: int) -> None:
    """Does the flash kernel skip key tiles that the mask sets to -inf for every row?
    [1, 1, 1024, 128] queries on 4096 keys: zero mask, the second half -inf, and the first
    half of the keys alone without a mask."""
    q = torch.randn(1, 1, 1024, 128, dtype=dtype)
    k, v = torch.randn(1, 1, 4096, 128, dtype=dtype), torch.randn(1, 1, 4096, 128, dtype=dtype)
    zero = torch.zeros(1024, 4096, dtype=dtype)
    half = zero.clone()
    half[:, 2048:] = float("-inf")
    kh, vh = k[:, :, :2048].contiguous(), v[:, :, :2048].contiguous()
    cases = [(k, v, zero), (k, v, half), (kh, vh, None)]
    ms = []
    for kk, vv, mask in cases:
        F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
        ts = []
        for _ in range(rounds + 2):
            t0 = time.perf_counter()
            F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
            ts.append(time.perf_counter() - t0)
        ms.append(min(ts) * 1e3)
    print(
        f"{str(dtype)[6:]:>9} masked tiles: zero mask {ms[0]:.2f} ms, half -inf {ms[1]:.2f} ms, "
        f"half the keys {ms[2]:.2f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--alpha", type=float, nargs="+", default=[1.25, 1.5])
    parser.add_argument("--mask-only", action="store_true", help="only the mask checks")
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, "
        f"{torch.get_num_threads()} threads, [1, 12, 8064, 128], {args.rounds} rounds"
    )
    with torch.inference_mode():
        for dtype in (torch.bfloat16, torch.float32):
            mask_cost(dtype, args.rounds)
            masked_tiles(dtype, args.rounds)
    if args.mask_only:
        return
    header = f"{'dtype':>9} {'keep':>5} {'variant':>12} {'min ms':>8} {'med ms':>8}"
    header += f" {'vs dense':>9} {'eff':>5} {'union/sel':>10} {'max err':>8}"
    print(header)
    with torch.inference_mode():
        for dtype in (torch.bfloat16, torch.float32):
            q, k, v = video_attention(21, 16, 24, dtype=dtype)
            for keep in (0.25, 0.5):
                mask, _ = ditops.estimate_block_mask(
                    q, k, keep_ratio=keep, dense_blocks=3, method="sampled"
                )
                mask = mask.bool()
                runs, ratios = variants(q, k, v, mask, keep, args.alpha)
                ref = runs["gathered"]().float()
                errs = {name: (f().float() - ref).abs().max().item() for name, f in runs.items()}
                times = interleaved(runs, args.rounds)
                d = statistics.median(times["dense"])
                for name, ts in times.items():
                    med = statistics.median(ts)
                    sp = d / med
                    err = "-" if name == "dense" else f"{errs[name]:.1e}"
                    print(
                        f"{str(dtype)[6:]:>9} {keep:>5} {name:>12} {min(ts) * 1e3:>8.0f} "
                        f"{med * 1e3:>8.0f} {sp:>9.2f} {sp * keep:>5.2f} "
                        f"{ratios[name]:>10.2f} {err:>8}"
                    )


if __name__ == "__main__":
    main()
