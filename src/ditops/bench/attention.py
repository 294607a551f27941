"""Benchmark suite ``attention``: adaptive block-sparse attention, speed and quality.

Inputs are structured, video-like queries and keys (:func:`video_qk`): tokens on a
``frames x height x width`` grid whose features vary smoothly with position, so
attention is local in space and time as in video DiTs; values are random.
``[1, 12, S, 128]`` bf16, S = frames x 32 x 32.

Speed (``ditops bench attention``), per (S, keep ratio k), all timed in one run:

* ``native``: dense SDPA, the attention the sparse op replaces (``x native`` is the
  speedup over it);
* ``estimate``: ``estimate_block_mask`` alone (``1 / x native`` is its cost as a share
  of a dense attention; the target is <= 5%);
* ``sparse``: ``block_sparse_attention`` alone with a mask keeping exactly
  ``round(k * KVb)`` blocks per row (the top blocks of the estimator's scores); the
  target is ``x native >= 0.8 / k``;
* ``est+sparse``: estimation with ``keep_ratio=k`` then attention with that mask (its
  density is a little above k: sink, recent and ties are kept too).

Quality (params of each case, and the table printed by ``python -m
ditops.bench.attention``): the estimated mask's share of the exact softmax mass,
against the oracle mask with the same number of blocks per row (target >= 0.9 at
k = 0.25), and the relative error of the sparse output against dense attention (for the
estimated and for the oracle mask).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from ditops.attention.block_mask import density_stats, num_blocks, row_counts
from ditops.attention.estimate import block_scores
from ditops.bench.harness import Case
from ditops.bench.suites import Suite, register_suite

HEADS, DIM, BLOCK, STRIDE = 12, 128, 128, 8
GRID = 32  # height = width = 32 tokens per frame side: 1024 tokens per frame
FRAMES = {"small": (4,), "full": (4, 8)}  # S = 4096, 8192
KEEPS = (0.5, 0.25, 0.1)
VARIANTS = ("native", "estimate", "sparse", "est+sparse")


def video_qk(
    frames: int,
    height: int,
    width: int,
    heads: int = HEADS,
    dim: int = DIM,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Structured ``[1, heads, frames * height * width, dim]`` queries and keys.

    Each head projects the token's (t, y, x) position through random frequencies into
    sin/cos features (so ``q . k`` peaks where positions are close, the way RoPE'd
    video attention does), plus noise; heads differ in reach (frequency scale) and
    sharpness (amplitude).
    """
    gen = torch.Generator().manual_seed(seed)
    t, y, x = torch.meshgrid(
        torch.arange(frames, dtype=torch.float32),
        torch.arange(height, dtype=torch.float32),
        torch.arange(width, dtype=torch.float32),
        indexing="ij",
    )
    pos = torch.stack([t.flatten(), y.flatten(), x.flatten()], dim=-1)  # [S, 3]
    reach = torch.exp(torch.empty(heads).uniform_(math.log(0.05), math.log(0.4), generator=gen))
    amp = torch.empty(heads).uniform_(1.0, 1.6, generator=gen)
    freqs = torch.randn(heads, 3, dim // 2, generator=gen) * reach[:, None, None]
    phase = torch.einsum("sc,hcf->hsf", pos, freqs)
    base = torch.cat([phase.sin(), phase.cos()], dim=-1)  # [H, S, D], |row|^2 = D / 2
    noise = 0.3
    q = amp[:, None, None] * (base + noise * torch.randn(base.shape, generator=gen))
    k = amp[:, None, None] * (base + noise * torch.randn(base.shape, generator=gen))
    return q[None].to(dtype), k[None].to(dtype)


def exact_block_mass(q: torch.Tensor, k: torch.Tensor, block_size: int = BLOCK) -> torch.Tensor:
    """fp32 ``[B, H, Qb, KVb]``: exact softmax mass each query block gives each key block."""
    batch, heads, seq, dim = q.shape
    blocks = num_blocks(seq, block_size)
    out = torch.zeros(batch, heads, blocks, blocks, device=q.device)
    col_block = torch.arange(k.shape[2], device=q.device) // block_size
    for b in range(batch):
        for h in range(heads):
            kf = k[b, h].float()
            for r in range(blocks):
                rows = q[b, h, r * block_size : (r + 1) * block_size].float()
                p = torch.softmax(rows @ kf.T * dim**-0.5, dim=-1).sum(0)
                out[b, h, r].index_add_(0, col_block, p)
    return out


def top_blocks_mask(scores: torch.Tensor, keep: float) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 mask keeping exactly ``max(1, round(keep * KVb))`` top-scoring blocks per row."""
    n = max(1, round(keep * scores.shape[-1]))
    mask = torch.zeros(scores.shape, dtype=torch.int8, device=scores.device)
    mask.scatter_(-1, scores.topk(n, dim=-1).indices, 1)
    return mask, row_counts(mask)


def _oracle_like(mass: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The oracle mask: per row, the ``counts`` blocks of largest exact mass."""
    order = mass.argsort(dim=-1, descending=True)
    ranks = torch.empty_like(order).scatter_(
        -1, order, torch.arange(mass.shape[-1], device=mass.device).expand_as(order)
    )
    return (ranks < counts[..., None]).to(torch.int8)


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def quality(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: float, dense: torch.Tensor
) -> dict[str, float]:
    """Mass recall of the estimated mask against the oracle, output errors against dense
    attention, and the error of the path that ran against ``forward_native`` (as a share
    of ``max|v|``: the correctness check of this device's fast path)."""
    from ditops.layers.attention import block_sparse_attention, estimate_block_mask

    mass = exact_block_mass(q, k)
    with torch.inference_mode():
        mask, counts = estimate_block_mask(q, k, keep_ratio=keep)
        oracle = _oracle_like(mass, counts)
        kept = (mass * mask).sum(dim=(-1, -2)) / (mass * oracle).sum(dim=(-1, -2))  # [B, H]
        out = block_sparse_attention(q, k, v, mask, counts)
        out_oracle = block_sparse_attention(q, k, v, oracle, counts)
        native = block_sparse_attention.forward_native(
            q, k, v, mask, counts, layout="BNSD", scale=None, causal=False, block_size=BLOCK
        )
    seq = q.shape[2]
    stats = density_stats(mask, q_len=seq, kv_len=seq, block_size=BLOCK)
    total = float((mass * mask).sum() / (mass * oracle).sum())
    return {
        "density": stats.density,
        "mass_vs_oracle": total,
        "mass_vs_oracle_worst_head": float(kept.min()),
        "mass_kept": float((mass * mask).sum() / mass.sum()),
        "oracle_mass_kept": float((mass * oracle).sum() / mass.sum()),
        "rel_err": _relative_error(out, dense),
        "oracle_rel_err": _relative_error(out_oracle, dense),
        "path_vs_native": float((out.float() - native.float()).abs().max() / v.abs().max()),
    }


def _inputs(frames: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    q, k = video_qk(frames, GRID, GRID)
    v = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q.dtype)
    return tuple(t.to(device) for t in (q, k, v))


def cases(device: torch.device, size: str) -> Iterator[Case]:
    from ditops.layers.attention import block_sparse_attention, estimate_block_mask

    for frames in FRAMES[size]:
        q, k, v = _inputs(frames, device)
        seq = q.shape[2]
        with torch.inference_mode():
            dense = F.scaled_dot_product_attention(q, k, v)
            scores = block_scores(
                q, k, block_size=BLOCK, stride=STRIDE, score_scale=DIM**-0.5 / STRIDE, causal=False
            )
        for keep in KEEPS:
            mask, counts = top_blocks_mask(scores, keep)
            params: dict[str, Any] = {"S": seq, "heads": HEADS, "dim": DIM, "dtype": "bfloat16"}
            params["keep"] = keep
            params["target_sparse_speedup"] = 0.8 / keep
            params.update(quality(q, k, v, keep, dense))

            def sdpa(q=q, k=k, v=v) -> torch.Tensor:
                with torch.inference_mode():
                    return F.scaled_dot_product_attention(q, k, v)

            def est(q=q, k=k, keep=keep) -> Any:
                with torch.inference_mode():
                    return estimate_block_mask(q, k, keep_ratio=keep)

            def sparse(q=q, k=k, v=v, mask=mask, counts=counts) -> torch.Tensor:
                with torch.inference_mode():
                    return block_sparse_attention(q, k, v, mask, counts)

            def both(q=q, k=k, v=v, keep=keep) -> torch.Tensor:
                with torch.inference_mode():
                    m, c = estimate_block_mask(q, k, keep_ratio=keep)
                    return block_sparse_attention(q, k, v, m, c)

            yield Case(
                suite="attention",
                name=f"S={seq} keep={keep}",
                variants=dict(zip(VARIANTS, (sdpa, est, sparse, both))),
                params=params,
            )


def _steps(size: str) -> int:
    return len(FRAMES[size]) * len(KEEPS) * len(VARIANTS)


SUITE = register_suite(
    Suite(
        name="attention",
        title="adaptive block-sparse attention, [1, 12, S, 128] bf16, video-like q/k",
        cases=cases,
        steps=_steps,
    )
)


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per case: the figures the issue's targets are about, from :func:`ratios` rows."""
    by_case: dict[str, dict[str, dict[str, Any]]] = {}
    for row in rows:
        if row["suite"] == "attention":
            by_case.setdefault(row["case"], {})[row["variant"]] = row
    out = []
    for name, variants in by_case.items():
        p = {k[2:]: v for k, v in variants["native"].items() if k.startswith("p_")}
        keep = p["keep"]
        sparse = variants["sparse"]["vs_native"]
        out.append(
            {
                "case": name,
                **p,
                "sparse_speedup": sparse,
                "sparse_target_met": sparse is not None and sparse >= 0.8 / keep,
                "sparse_speedup_times_keep": None if sparse is None else sparse * keep,
                "est_sparse_speedup": variants["est+sparse"]["vs_native"],
                "estimate_share_of_dense": (
                    1 / variants["estimate"]["vs_native"]
                    if variants["estimate"]["vs_native"]
                    else None
                ),
            }
        )
    return out


def print_summary(summ: list[dict[str, Any]], out: Any = sys.stdout) -> None:
    print(
        f"\n{'case':<20} {'density':>7} {'mass/oracle':>11} {'worst head':>10} "
        f"{'rel err':>8} {'oracle err':>10} {'sparse x':>8} {'target':>6} {'x*k':>5} "
        f"{'est+sp x':>8} {'est cost':>8} {'path err':>8}",
        file=out,
    )
    for s in summ:

        def f(v: Any, spec: str) -> str:
            return "-" if v is None else format(v, spec)

        print(
            f"{s['case']:<20} {s['density']:>7.3f} {s['mass_vs_oracle']:>11.3f} "
            f"{s['mass_vs_oracle_worst_head']:>10.3f} {s['rel_err']:>8.4f} "
            f"{s['oracle_rel_err']:>10.4f} {f(s['sparse_speedup'], '8.2f')} "
            f"{s['target_sparse_speedup']:>6.2f} {f(s['sparse_speedup_times_keep'], '5.2f')} "
            f"{f(s['est_sparse_speedup'], '8.2f')} {f(s['estimate_share_of_dense'], '8.1%')} "
            f"{s['path_vs_native']:>8.1e}",
            file=out,
        )
    print(
        "\nmass/oracle: softmax mass inside the estimated mask over the oracle's with as many "
        "blocks per row (target >= 0.9 at keep 0.25). sparse x: attention alone vs dense "
        "SDPA with exactly keep of the blocks (target >= 0.8 / keep). est cost: estimation "
        "as a share of dense SDPA (target <= 5%). path err: the path that ran against "
        "forward_native, in units of max|v|.",
        file=out,
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m ditops.bench.attention``: speed and quality tables, targets checked."""
    from ditops.bench.harness import machine_info, print_table, ratios, run_cases, write_json

    parser = argparse.ArgumentParser(prog="python -m ditops.bench.attention")
    parser.add_argument("--size", choices=("small", "full"), default="small")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None, metavar="PATH")
    parser.add_argument("--min-seconds", type=float, default=0.5)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    results = list(
        run_cases(
            cases(device, args.size),
            device,
            n_steps=_steps(args.size),
            desc="attention",
            progress=not args.no_progress,
            min_seconds=args.min_seconds,
        )
    )
    rows = ratios(results)
    print_table(rows)
    summ = summary(rows)
    print_summary(summ)
    if args.json:
        payload = {
            "machine": machine_info(device),
            "command": " ".join(["python -m ditops.bench.attention", *(argv or sys.argv[1:])]),
            "rows": rows,
            "summary": summ,
        }
        write_json(args.json, payload)
        print(f"\nwrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
