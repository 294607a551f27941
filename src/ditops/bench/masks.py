"""Benchmark suite ``masks``: the estimator's methods on video-like attention.

Inputs: :func:`ditops.bench.video_attention.video_attention` (spatial, temporal, mixed
and diffuse heads, global tokens), ``[1, 12, S, 128]`` in the suite's dtype (bf16 by
default; ``python -m ditops.bench.masks --dtype float32``), the first frame's blocks
forced and paid from the budget as ``BlockSparseConfig`` does. ``small``: Wan's 21
latent frames of 16 x 24 tokens (S = 8064); ``full`` adds three shapes no test was
tuned on (:data:`ditops.bench.video_attention.SHAPES`).

Per shape and density (``keep``), every method of
:data:`ditops.attention.methods.METHODS` estimates a mask with ``estimate_block_mask``
on this device's path, and the table gives:

* the softmax mass the mask keeps over the **per-row oracle**'s (the best mask with the
  same number of blocks in every row) and over the **per-head oracle**'s (the best with
  the same number per head), both keeping the same forced blocks; the worst head's;
* the attention output's relative L2 error against dense attention, and that error over
  the per-row oracle mask's (``err/or``; the issue's target: <= 1.2 at keep 0.25);
* the estimate's time as a share of dense SDPA (``est %``, target <= 5%) and the sparse
  attention's speedup over dense SDPA with that mask (``attn x``), timed in one run.

``--plot PATH`` draws mass kept (over the per-row oracle) and output error against the
density, one line per method.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ditops.attention.methods import DEFAULT_SAMPLES, METHODS
from ditops.attention.selection import forced_block_mask
from ditops.bench.harness import Case, variants_by_case
from ditops.bench.suite import Suite
from ditops.bench.video_attention import SHAPES, exact_block_mass, mask_quality, video_attention

HEADS, DIM, BLOCK, STRIDE = 12, 128, 128, 8
KEEPS = (0.5, 0.25, 0.15)
SIZES = {"small": ("wan",), "full": ("wan", "wide", "tall", "long")}
FLAGS = {"keep_sink": True, "keep_recent": True, "causal": False}


def first_frame_blocks(shape: Sequence[int], block_size: int = BLOCK) -> int:
    return math.ceil(shape[1] * shape[2] / block_size)


def cases_for(
    shapes: Sequence[tuple[int, int, int]],
    device: torch.device,
    *,
    dtype: torch.dtype = torch.bfloat16,
    keeps: Sequence[float] = KEEPS,
    methods: Sequence[str] = tuple(METHODS),
    heads: int = HEADS,
    dim: int = DIM,
    block_size: int = BLOCK,
    stride: int = STRIDE,
    samples: int = DEFAULT_SAMPLES,
) -> Iterator[Case]:
    """One case per (shape, keep): dense SDPA, then ``est <method>`` and ``attn <method>``
    for each method; the quality of each method's mask in the case's params."""
    from ditops.ops.block_sparse_attention import block_sparse_attention
    from ditops.ops.estimate_block_mask import estimate_block_mask

    for shape in shapes:
        q, k, v = (t.to(device) for t in video_attention(*shape, heads=heads, dim=dim, dtype=dtype))
        seq = int(q.shape[2])
        ff = first_frame_blocks(shape, block_size)
        qf, kf = q.float().cpu(), k.float().cpu()
        mass = exact_block_mass(qf, kf, block_size)
        blocks = int(mass.shape[-1])
        forced = forced_block_mask(blocks, blocks, dense_blocks=ff, **FLAGS)
        with torch.inference_mode():
            dense = F.scaled_dot_product_attention(qf, kf, v.float().cpu())
        for keep in keeps:
            variants: dict[str, Any] = {}
            quality: dict[str, dict[str, float]] = {}

            def sdpa(q=q, k=k, v=v) -> torch.Tensor:
                with torch.inference_mode():
                    return F.scaled_dot_product_attention(q, k, v)

            variants["native"] = sdpa
            for method in methods:
                opts = {"keep_ratio": keep, "dense_blocks": ff, "block_size": block_size,
                        "stride": stride, "method": method, "samples": samples}  # fmt: skip
                with torch.inference_mode():
                    mask, counts = estimate_block_mask(q, k, **opts)
                quality[method] = mask_quality(
                    mass, mask.cpu(), qf, kf, v.float().cpu(), dense,
                    forced=forced, block_size=block_size,
                ).as_dict()  # fmt: skip

                def est(q=q, k=k, opts=opts) -> Any:
                    with torch.inference_mode():
                        return estimate_block_mask(q, k, **opts)

                def attn(q=q, k=k, v=v, mask=mask, counts=counts) -> torch.Tensor:
                    with torch.inference_mode():
                        return block_sparse_attention(q, k, v, mask, counts, block_size=block_size)

                variants[f"est {method}"] = est
                variants[f"attn {method}"] = attn
            params = {"S": seq, "shape": list(shape), "keep": keep, "first_frame_blocks": ff,
                      "dtype": str(dtype).replace("torch.", ""), "samples": samples,
                      "quality": quality}  # fmt: skip
            yield Case(suite="masks", name=f"S={seq} keep={keep}", variants=variants, params=params)


def cases(device: torch.device, size: str, dtype: torch.dtype = torch.bfloat16) -> Iterator[Case]:
    return cases_for([SHAPES[s] for s in SIZES[size]], device, dtype=dtype)


def _steps(size: str) -> int:
    return len(SIZES[size]) * len(KEEPS) * (1 + 2 * len(METHODS))


SUITE = Suite(
    name="masks",
    title="block-mask estimation methods, [1, 12, S, 128], video-like attention",
    cases=cases,
    steps=_steps,
)


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (case, method): quality against both oracles, estimate cost, attention speedup."""
    out = []
    for name, variants in variants_by_case(rows, "masks").items():
        native = variants["native"]
        quality = native["p_quality"]
        for method, q in quality.items():
            est, attn = variants[f"est {method}"], variants[f"attn {method}"]
            out.append(
                {
                    "case": name,
                    "S": native["p_S"],
                    "keep": native["p_keep"],
                    "method": method,
                    **q,
                    "dense_ms": native["median_ms"],
                    "estimate_ms": est["median_ms"],
                    "estimate_share": 1 / est["vs_native"] if est["vs_native"] else None,
                    "estimate_share_cpu": (
                        1 / est["vs_native_cpu"] if est.get("vs_native_cpu") else None
                    ),
                    "attention_speedup": attn["vs_native"],
                }
            )
    return out


def print_summary(summ: list[dict[str, Any]], out: Any = None) -> None:
    out = out or sys.stdout

    def f(v: Any, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    print(
        f"\n{'case':<20} {'method':<18} {'density':>7} {'mass':>6} {'/row or':>7} "
        f"{'/head or':>8} {'worst r':>7} {'worst h':>7} {'rel err':>7} {'row or':>7} "
        f"{'head or':>7} {'err/or':>6} {'est %':>6} {'est%cpu':>7} {'attn x':>6}",
        file=out,
    )
    for s in summ:
        share, cpu = s["estimate_share"], s["estimate_share_cpu"]
        print(
            f"{s['case']:<20} {s['method']:<18} {s['density']:>7.3f} {s['mass_kept']:>6.3f} "
            f"{s['mass_vs_row']:>7.3f} {s['mass_vs_head']:>8.3f} {s['worst_head_vs_row']:>7.3f} "
            f"{s['worst_head_vs_head']:>7.3f} {s['rel_err']:>7.4f} {s['row_oracle_err']:>7.4f} "
            f"{s['head_oracle_err']:>7.4f} {s['err_vs_row_oracle']:>6.2f} "
            f"{f(None if share is None else 100 * share, '6.1f')} "
            f"{f(None if cpu is None else 100 * cpu, '7.1f')} "
            f"{f(s['attention_speedup'], '6.2f')}",
            file=out,
        )
    print(
        "\ndensity: block density of the mask (forced blocks included). mass: its share of "
        "the softmax mass; /row or, /head or: over the per-row and per-head oracles' (the "
        "best masks with as many blocks per row, per head, the same forced blocks; worst "
        "r/h: the worst head's). rel err: the attention output's relative L2 error against "
        "dense attention; row or, head or: the oracles' masks'; err/or: rel err over row "
        "or. est %: the estimate's time over dense SDPA's (wall; est%cpu: CPU time). "
        "attn x: the sparse attention with that mask against dense SDPA.",
        file=out,
    )


def plot(summ: list[dict[str, Any]], path: str) -> None:
    """Mass kept (over the per-row oracle) and output error against density, per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    for s_len in sorted({s["S"] for s in summ}):
        for method in dict.fromkeys(s["method"] for s in summ):
            pts = sorted(
                (s["density"], s) for s in summ if s["method"] == method and s["S"] == s_len
            )
            xs = [d for d, _ in pts]
            label = f"{method} (S={s_len})"
            ax.plot(xs, [s["mass_vs_row"] for _, s in pts], marker="o", label=label)
            bx.plot(xs, [s["err_vs_row_oracle"] for _, s in pts], marker="o", label=label)
    ax.axhline(0.97, color="grey", ls=":", lw=1)
    bx.axhline(1.2, color="grey", ls=":", lw=1)
    ax.set(xlabel="block density", ylabel="mass kept / per-row oracle's", title="mask quality")
    bx.set(xlabel="block density", ylabel="output rel. L2 error / oracle mask's",
           title="attention output", yscale="log")  # fmt: skip
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """``python -m ditops.bench.masks``: the table (and ``--plot``, ``--json``)."""
    from ditops.bench.harness import case_suite_parser, ratios, run_suite_cases, write_run_json

    prog = "python -m ditops.bench.masks"
    parser = case_suite_parser(prog, SIZES)
    parser.add_argument("--plot", default=None, metavar="PNG")
    args = parser.parse_args(argv)
    results = run_suite_cases(args, cases, _steps, "masks")
    summ = summary(ratios(list(results)))
    print_summary(summ)
    if args.plot:
        plot(summ, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.json:
        write_run_json(args.json, torch.device(args.device), prog, argv, summary=summ)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
