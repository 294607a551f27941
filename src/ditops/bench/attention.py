"""Benchmark suite ``attention``: adaptive block-sparse attention, speed and quality.

Inputs are structured, video-like queries and keys (:func:`video_qk`): tokens on a
``frames x height x width`` grid whose features vary smoothly with position, so
attention is local in space and time as in video DiTs; values are random.
``[1, 12, S, 128]`` in Wan's geometry after 2x2 patching: 21 latent frames of 16 x 24
tokens (S = 8064, the first frame 3 blocks of 128); ``full`` adds Wan 480p, 21 x 30 x 52
(S = 32760, the first frame 13 blocks). bf16 (``--dtype float32`` in ``python -m``).

Speed (``ditops bench attention``), per (S, density k = 1 - sparsity), all timed in one
run:

* ``native``: dense SDPA, the attention the sparse op replaces (``x native`` is the
  speedup over it);
* ``estimate``: ``estimate_block_mask`` alone with ``keep_ratio=k``, the layer's default
  method (:data:`METHOD`; ``ditops bench masks`` compares them all) and the first frame
  forced (``1 / x native`` is its cost as a share of a dense attention; the target is
  <= 5%);
* ``sparse``: ``block_sparse_attention`` alone with that mask, whose block density is k
  (forced blocks included; the forced blocks alone when they are more, here at k = 0.1:
  0.108); the target is ``x native >= 0.8 / density``;
* ``est+sparse``: both, what a sparse step's self-attention costs.

Quality (params of each case, and the table printed by ``python -m
ditops.bench.attention``): the estimated mask's share of the exact softmax mass,
against the oracle mask with the same number of blocks per row (target >= 0.9 at
k = 0.25), and the sparse output against dense attention (max abs, cosine, PSNR,
relative L2; for the oracle mask too).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from ditops.attention.block_mask import density_stats, num_blocks
from ditops.attention.methods import DEFAULT_METHOD
from ditops.bench.accuracy import relative_error
from ditops.bench.harness import Case, variants_by_case
from ditops.bench.suite import Suite

HEADS, DIM, BLOCK, STRIDE = 12, 128, 128, 8
#: (frames, height, width) in tokens: Wan's 21 latent frames, small and 480p.
SHAPES = {"small": ((21, 16, 24),), "full": ((21, 16, 24), (21, 30, 52))}
KEEPS = (0.5, 0.25, 0.1)
#: The estimate method measured: the one ``BlockSparseConfig`` (the layer) runs by default.
METHOD = DEFAULT_METHOD
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


def _oracle_like(mass: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The oracle mask: per row, the ``counts`` blocks of largest exact mass."""
    order = mass.argsort(dim=-1, descending=True)
    ranks = torch.empty_like(order).scatter_(
        -1, order, torch.arange(mass.shape[-1], device=mass.device).expand_as(order)
    )
    return (ranks < counts[..., None]).to(torch.int8)


def quality(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keep: float,
    dense: torch.Tensor,
    dense_blocks: int = 0,
) -> dict[str, float]:
    """Mass recall of the estimated mask against the oracle, output errors against dense
    attention, and the error of the path that ran against ``forward_native`` (as a share
    of ``max|v|``: the correctness check of this device's fast path)."""
    from ditops.bench.accuracy import drift
    from ditops.ops.block_sparse_attention import block_sparse_attention
    from ditops.ops.estimate_block_mask import estimate_block_mask

    mass = exact_block_mass(q, k)
    with torch.inference_mode():
        mask, counts = estimate_block_mask(
            q, k, keep_ratio=keep, dense_blocks=dense_blocks, method=METHOD
        )
        oracle = _oracle_like(mass, counts)
        kept = (mass * mask).sum(dim=(-1, -2)) / (mass * oracle).sum(dim=(-1, -2))  # [B, H]
        out = block_sparse_attention(q, k, v, mask, counts)
        out_oracle = block_sparse_attention(q, k, v, oracle, counts)
        native = block_sparse_attention.op.forward_native(
            q, k, v, mask, counts, layout="BNSD", scale=None, causal=False, block_size=BLOCK
        )
    seq = q.shape[2]
    stats = density_stats(mask, q_len=seq, kv_len=seq, block_size=BLOCK)
    total = float((mass * mask).sum() / (mass * oracle).sum())
    max_abs, cosine, psnr = drift(out, dense)
    return {
        "density": stats.block_density,
        "token_density": stats.density,
        "max_abs": max_abs,
        "cosine": cosine,
        "psnr": psnr,
        "mass_vs_oracle": total,
        "mass_vs_oracle_worst_head": float(kept.min()),
        "mass_kept": float((mass * mask).sum() / mass.sum()),
        "oracle_mass_kept": float((mass * oracle).sum() / mass.sum()),
        "rel_err": relative_error(out, dense),
        "oracle_rel_err": relative_error(out_oracle, dense),
        "path_vs_native": float((out.float() - native.float()).abs().max() / v.abs().max()),
    }


def _inputs(
    shape: tuple[int, int, int], device: torch.device, dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, ...]:
    q, k = video_qk(*shape, dtype=dtype)
    v = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q.dtype)
    return tuple(t.to(device) for t in (q, k, v))


def cases(device: torch.device, size: str, dtype: torch.dtype = torch.bfloat16) -> Iterator[Case]:
    from ditops.ops.block_sparse_attention import block_sparse_attention
    from ditops.ops.estimate_block_mask import estimate_block_mask

    for shape in SHAPES[size]:
        q, k, v = _inputs(shape, device, dtype)
        seq = q.shape[2]
        first_frame = math.ceil(shape[1] * shape[2] / BLOCK)
        with torch.inference_mode():
            dense = F.scaled_dot_product_attention(q, k, v)
        for keep in KEEPS:
            opts = {"keep_ratio": keep, "dense_blocks": first_frame, "method": METHOD}
            with torch.inference_mode():
                mask, counts = estimate_block_mask(q, k, **opts)
            params: dict[str, Any] = {"S": seq, "heads": HEADS, "dim": DIM}
            params["dtype"] = str(dtype).replace("torch.", "")
            params["keep"] = keep
            params["first_frame_blocks"] = first_frame
            params["method"] = METHOD
            params.update(quality(q, k, v, keep, dense, first_frame))
            params["target_sparse_speedup"] = 0.8 / params["density"]

            def sdpa(q=q, k=k, v=v) -> torch.Tensor:
                with torch.inference_mode():
                    return F.scaled_dot_product_attention(q, k, v)

            def est(q=q, k=k, opts=opts) -> Any:
                with torch.inference_mode():
                    return estimate_block_mask(q, k, **opts)

            def sparse(q=q, k=k, v=v, mask=mask, counts=counts) -> torch.Tensor:
                with torch.inference_mode():
                    return block_sparse_attention(q, k, v, mask, counts)

            def both(q=q, k=k, v=v, opts=opts) -> torch.Tensor:
                with torch.inference_mode():
                    m, c = estimate_block_mask(q, k, **opts)
                    return block_sparse_attention(q, k, v, m, c)

            yield Case(
                suite="attention",
                name=f"S={seq} keep={keep}",
                variants=dict(zip(VARIANTS, (sdpa, est, sparse, both))),
                params=params,
            )


def _steps(size: str) -> int:
    return len(SHAPES[size]) * len(KEEPS) * len(VARIANTS)


SUITE = Suite(
    name="attention",
    title=f"adaptive block-sparse attention, [1, 12, S, 128] bf16, video-like q/k, "
    f"mask method {METHOD!r}",
    cases=cases,
    steps=_steps,
)


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per case: the figures the issue's targets are about, from :func:`ratios` rows."""
    out = []
    for name, variants in variants_by_case(rows, "attention").items():
        p = {k[2:]: v for k, v in variants["native"].items() if k.startswith("p_")}
        density = p.get("density", p["keep"])
        sparse = variants["sparse"]["vs_native"]
        estimate = variants["estimate"]["vs_native"]
        out.append(
            {
                "case": name,
                **p,
                "dense_ms": variants["native"]["median_ms"],
                "estimate_ms": variants["estimate"]["median_ms"],
                "sparse_ms": variants["sparse"]["median_ms"],
                "sparse_speedup": sparse,
                "sparse_target_met": sparse is not None and sparse >= 0.8 / density,
                "sparse_speedup_times_density": None if sparse is None else sparse * density,
                "est_sparse_speedup": variants["est+sparse"]["vs_native"],
                "estimate_share_of_dense": 1 / estimate if estimate else None,
            }
        )
    return out


def print_summary(summ: list[dict[str, Any]], out: Any = sys.stdout) -> None:
    def f(v: Any, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    print(
        f"\n{'case':<20} {'density':>7} {'est ms':>8} {'attn ms':>8} {'dense ms':>8} "
        f"{'attn x':>6} {'target':>6} {'x*d':>5} {'est+at x':>8} {'est %':>6} "
        f"{'mass/or':>7} {'worst h':>7} {'max abs':>8} {'cosine':>8} {'PSNR':>5} "
        f"{'rel err':>7} {'or err':>7} {'path err':>8}",
        file=out,
    )
    for s in summ:
        share = s["estimate_share_of_dense"]
        share = None if share is None else 100 * share
        print(
            f"{s['case']:<20} {s['density']:>7.3f} {f(s['estimate_ms'], '8.1f')} "
            f"{f(s['sparse_ms'], '8.1f')} {f(s['dense_ms'], '8.1f')} "
            f"{f(s['sparse_speedup'], '6.2f')} {s['target_sparse_speedup']:>6.2f} "
            f"{f(s['sparse_speedup_times_density'], '5.2f')} "
            f"{f(s['est_sparse_speedup'], '8.2f')} {f(share, '6.1f')} "
            f"{s['mass_vs_oracle']:>7.3f} {s['mass_vs_oracle_worst_head']:>7.3f} "
            f"{s['max_abs']:>8.2e} {s['cosine']:>8.5f} {s['psnr']:>5.1f} "
            f"{s['rel_err']:>7.4f} {s['oracle_rel_err']:>7.4f} {s['path_vs_native']:>8.1e}",
            file=out,
        )
    print(
        "\ndensity: block density of the estimated mask (first frame, sink and recent "
        "blocks included: the density asked for, or the forced blocks alone when they are "
        "more). est ms / attn ms: the estimate and the sparse attention alone; attn x: the "
        "attention alone against dense SDPA (target >= 0.8 / density; x*d: its share of "
        "the ideal); est+at x: both, a sparse step's self-attention; est %: the estimate "
        "as a share of dense SDPA (target <= 5%). mass/or: softmax mass inside the "
        "estimated mask over the oracle's with as many blocks per row (worst h: worst "
        "head; target >= 0.9 at keep 0.25). max abs, cosine, PSNR, rel err: the sparse "
        "output against dense attention (or err: with the oracle mask). path err: the path "
        "that ran against forward_native, in units of max|v|.",
        file=out,
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m ditops.bench.attention``: speed and quality tables, targets checked."""
    from ditops.bench.harness import (
        case_suite_parser,
        print_table,
        ratios,
        run_suite_cases,
        write_run_json,
    )

    prog = "python -m ditops.bench.attention"
    args = case_suite_parser(prog, ("small", "full")).parse_args(argv)
    results = run_suite_cases(args, cases, _steps, "attention")
    rows = ratios(results)
    print_table(rows)
    summ = summary(rows)
    print_summary(summ)
    if args.json:
        write_run_json(args.json, torch.device(args.device), prog, argv, rows=rows, summary=summ)
        print(f"\nwrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
