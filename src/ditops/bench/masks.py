"""Benchmark suite ``masks``: the estimator's methods on video-like attention.

Inputs: :func:`ditops.bench.video_attention.video_attention` (spatial, temporal, mixed
and diffuse heads, global tokens), ``[1, 12, S, 128]`` in the suite's dtype (bf16 by
default; ``python -m ditops.bench.masks --dtype float32``), the first frame's blocks
forced and paid from the budget as ``BlockSparseConfig`` does. ``small``: Wan's 21
latent frames of 16 x 24 tokens (S = 8064); ``full`` adds three shapes no test was
tuned on (:data:`ditops.bench.video_attention.SHAPES`) and ``wan_model``.

``wan_model`` (also ``--size wan_model`` alone): the q, k and v of the bench's small Wan
model itself (:data:`ditops.bench.wan_model.DEFAULT_CONFIG`, random weights, in the
suite's dtype), captured in blocks 0 and 1's self-attention after ``norm_q``/``norm_k``
and the rotary embedding (:func:`wan_model_qkv`), on a latent of 9 frames of 16 x 24
tokens (S = 3456: 27 blocks of 128, the first frame 3 of them), at keep 0.5 and 0.25.

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
from ditops.bench.harness import Case, variants_by_case
from ditops.bench.masks_scattered import SCATTERED_KEEPS, plot_scattered, scattered_cases
from ditops.bench.suite import Suite
from ditops.bench.video_attention import (
    BLOCK,
    DIM,
    HEADS,
    SHAPES,
    STRIDE,
    MaskReference,
    video_attention,
)

KEEPS = (0.5, 0.25, 0.15)
SIZES = {
    "small": ("wan",),
    "full": ("wan", "wide", "tall", "long", "wan_model", "scattered"),
    "wan_model": ("wan_model",),
    "scattered": ("scattered",),
}
#: The Wan model source: latent (frames, height, width) -- tokens (9, 16, 24) after the
#: 1 x 2 x 2 patch --, the blocks whose self-attention is captured, the densities.
WAN_LATENT, WAN_BLOCKS, WAN_KEEPS, WAN_TEXT_TOKENS = (9, 32, 48), (0, 1), (0.5, 0.25), 64


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
    for shape in shapes:
        qkv = video_attention(*shape, heads=heads, dim=dim, dtype=dtype)
        yield from cases_from(
            "", shape, *qkv, device, keeps=keeps, methods=methods,
            block_size=block_size, stride=stride, samples=samples,
        )  # fmt: skip


def cases_from(
    label: str,
    shape: Sequence[int],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    device: torch.device,
    *,
    keeps: Sequence[float] = KEEPS,
    methods: Sequence[str] = tuple(METHODS),
    block_size: int = BLOCK,
    stride: int = STRIDE,
    samples: int = DEFAULT_SAMPLES,
    extra: dict[str, Any] | None = None,
) -> Iterator[Case]:
    """The cases of one BNSD ``q, k, v`` whose tokens are ``shape`` (frames, height,
    width), one per keep; ``label`` prefixes the case names, ``extra`` joins the params."""
    from ditops.ops.block_sparse_attention import block_sparse_attention
    from ditops.ops.estimate_block_mask import estimate_block_mask

    dtype = q.dtype
    q, k, v = (t.to(device) for t in (q, k, v))
    seq = int(q.shape[2])
    ref = MaskReference.of(q, k, v, shape, block_size)
    ff = ref.first_frame
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
            quality[method] = ref.quality(mask).as_dict()

            def est(q=q, k=k, opts=opts) -> Any:
                with torch.inference_mode():
                    return estimate_block_mask(q, k, **opts)

            def attn(q=q, k=k, v=v, mask=mask, counts=counts) -> torch.Tensor:
                with torch.inference_mode():
                    return block_sparse_attention(q, k, v, mask, counts, block_size=block_size)

            variants[f"est {method}"] = est
            variants[f"attn {method}"] = attn
        params = {"S": seq, "shape": list(shape), "keep": keep, "first_frame_blocks": ff,
                  "block_size": block_size, "dtype": str(dtype).replace("torch.", ""),
                  "samples": samples, "quality": quality, **(extra or {})}  # fmt: skip
        name = f"{label}S={seq} keep={keep}"
        yield Case(suite="masks", name=name, variants=variants, params=params)


class _CaptureQKV:
    """A processor wrapping ``attn1``'s: records the self-attention's q, k, v (BNSD) as
    diffusers' ``WanAttnProcessor`` forms them (projections, ``norm_q``/``norm_k``, the
    rotary embedding), then runs the wrapped processor unchanged."""

    def __init__(self, inner: Any, store: list[tuple[torch.Tensor, ...]]) -> None:
        self.inner, self.store = inner, store

    def __call__(self, attn: Any, hidden_states: torch.Tensor, *args: Any, **kw: Any) -> Any:
        from diffusers.models.transformers.transformer_wan import _get_qkv_projections

        rotary = kw.get("rotary_emb", args[2] if len(args) > 2 else None)
        with torch.no_grad():
            q, k, v = _get_qkv_projections(attn, hidden_states, None)
            q, k = attn.norm_q(q), attn.norm_k(k)
            q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))
            if rotary is not None:
                q, k = (_rotate(t, *rotary) for t in (q, k))
            self.store.append(tuple(t.transpose(1, 2).contiguous() for t in (q, k, v)))
        return self.inner(attn, hidden_states, *args, **kw)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' ``WanAttnProcessor`` rotary embedding (interleaved pairs)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


def wan_model_qkv(
    device: torch.device,
    dtype: torch.dtype,
    latent: Sequence[int] = WAN_LATENT,
    blocks: Sequence[int] = WAN_BLOCKS,
    text_tokens: int = WAN_TEXT_TOKENS,
    **overrides: Any,
) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """One forward of the bench's Wan model (:func:`ditops.bench.wan_model.build_model`,
    ``overrides`` on its config) on ``latent`` (frames, height, width): per block of
    ``blocks``, its self-attention's ``(block, q, k, v)``, BNSD."""
    from ditops.bench import wan_model

    model = wan_model.build_model(None, device, dtype, **overrides)
    config = {**wan_model.DEFAULT_CONFIG, **overrides}
    store: dict[int, list[tuple[torch.Tensor, ...]]] = {b: [] for b in blocks}
    for b in blocks:
        attn = model.blocks[b].attn1
        attn.set_processor(_CaptureQKV(attn.processor, store[b]))
    inputs = wan_model.make_inputs(config, tuple(latent), text_tokens, device, dtype)
    with torch.inference_mode():
        model(**inputs, return_dict=False)
    return [(b, *store[b][0]) for b in blocks]


def wan_model_tokens(latent: Sequence[int], patch: Sequence[int] = (1, 2, 2)) -> tuple[int, ...]:
    return tuple(n // p for n, p in zip(latent, patch, strict=True))


def wan_model_cases(
    device: torch.device,
    dtype: torch.dtype = torch.bfloat16,
    *,
    latent: Sequence[int] = WAN_LATENT,
    blocks: Sequence[int] = WAN_BLOCKS,
    keeps: Sequence[float] = WAN_KEEPS,
    text_tokens: int = WAN_TEXT_TOKENS,
    stride: int = STRIDE,
    samples: int = DEFAULT_SAMPLES,
    **overrides: Any,
) -> Iterator[Case]:
    """The cases of the Wan model's own q, k, v (:func:`wan_model_qkv`), per block and
    keep. Block size 128 when the sequence has >= 8 blocks of it, else the largest power
    of two (>= 16) that gives 8."""
    from ditops.bench import wan_model

    config = {**wan_model.DEFAULT_CONFIG, **overrides}
    shape = wan_model_tokens(latent, config["patch_size"])
    seq = math.prod(shape)
    block_size = BLOCK
    while block_size > 16 and seq // block_size < 8:
        block_size //= 2
    extra = {"source": "wan_model", "latent": list(latent), "config": {
        k: config[k] for k in ("num_layers", "num_attention_heads", "attention_head_dim",
                               "ffn_dim", "text_dim", "qk_norm")}}  # fmt: skip
    for b, q, k, v in wan_model_qkv(device, dtype, latent, blocks, text_tokens, **overrides):
        yield from cases_from(
            f"wan_model b{b} ", shape, q, k, v, device, keeps=keeps, block_size=block_size,
            stride=stride, samples=samples, extra={**extra, "block": b},
        )  # fmt: skip


def cases(device: torch.device, size: str, dtype: torch.dtype = torch.bfloat16) -> Iterator[Case]:
    shapes = [SHAPES[s] for s in SIZES[size] if s not in ("wan_model", "scattered")]
    yield from cases_for(shapes, device, dtype=dtype)
    if "wan_model" in SIZES[size]:
        yield from wan_model_cases(device, dtype)
    if "scattered" in SIZES[size]:
        yield from scattered_cases(device, dtype)


def _steps(size: str) -> int:
    per_keep = 1 + 2 * len(METHODS)
    shapes = [s for s in SIZES[size] if s not in ("wan_model", "scattered")]
    wan = len(WAN_BLOCKS) * len(WAN_KEEPS) if "wan_model" in SIZES[size] else 0
    scattered = 0
    if "scattered" in SIZES[size]:
        scattered = len(SCATTERED_KEEPS) * (1 + 2 * 2) + (1 + 2 * 4)
    return (len(shapes) * len(KEEPS) + wan) * per_keep + scattered


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
        f"\n{'case':<30} {'method':<18} {'density':>7} {'mass':>6} {'/row or':>7} "
        f"{'/head or':>8} {'worst r':>7} {'worst h':>7} {'rel err':>7} {'row or':>7} "
        f"{'head or':>7} {'err/or':>6} {'est %':>6} {'est%cpu':>7} {'attn x':>6}",
        file=out,
    )
    for s in summ:
        share, cpu = s["estimate_share"], s["estimate_share_cpu"]
        print(
            f"{s['case']:<30} {s['method']:<18} {s['density']:>7.3f} {s['mass_kept']:>6.3f} "
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
    scattered = [x for x in summ if x["case"].startswith("scattered")]
    if not scattered:
        return
    print(
        f"\n{'scattered case':<30} {'method':<22} {'density':>7} {'mass':>6} {'min h':>6} "
        f"{'rel err':>7} {'or here':>7} {'unp or':>7} {'err/unp':>7} {'fixed d':>7} "
        f"{'its mass':>8} {'est %':>6} {'attn x':>6}",
        file=out,
    )
    for x in scattered:
        unp = x.get("unpermuted_row_oracle_err")
        share = x["estimate_share"]
        print(
            f"{x['case']:<30} {x['method']:<22} {x['density']:>7.3f} {x['mass_kept']:>6.3f} "
            f"{f(x.get('coverage_min'), '6.3f')} {x['rel_err']:>7.4f} "
            f"{x['row_oracle_err']:>7.4f} {f(unp, '7.4f')} "
            f"{f(None if not unp else x['rel_err'] / unp, '7.2f')} "
            f"{f(x.get('fixed_density_same_mass'), '7.3f')} "
            f"{f(x.get('fixed_density_coverage'), '8.3f')} "
            f"{f(None if share is None else 100 * share, '6.1f')} "
            f"{f(x['attention_speedup'], '6.2f')}",
            file=out,
        )
    print(
        "\nscattered: semantic attention (objects scattered over the video; every 4th head "
        "local). 'perm': the permuted mode (per-head k-means, tokens sorted by cluster; each "
        "head keeps the order that serves it). mass: mean over heads of the exact mass kept; "
        "min h: the worst head's (mass targets); or here: the per-row oracle in the mask's "
        "own order; unp or: the video order's per-row oracle with the same blocks per row; "
        "err/unp: rel err over it (the issue's target: <= 0.7 at keep 0.25). fixed d: the "
        "smallest single density (same method and order) keeping at least that mean mass, "
        "and its mass. est %: estimate (with the warm-started clustering for perm) over "
        "dense SDPA; attn x: attention (with the permutations) against dense SDPA.",
        file=out,
    )


def plot(summ: list[dict[str, Any]], path: str) -> None:
    """Mass kept (over the per-row oracle) and output error against density, per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scattered = [s for s in summ if s["case"].startswith("scattered")]
    summ = [s for s in summ if not s["case"].startswith("scattered")]
    if scattered:
        plot_scattered(scattered, path.replace(".png", "") + "_scattered.png")
    if not summ:
        return
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
