"""Benchmark suite ``wan``, the default of ``ditops bench``: a small Wan model end to end.

A ``WanTransformer3DModel`` built from keyword arguments (random weights, no download;
or ``--model PATH``: a local diffusers checkpoint) runs a short denoising loop with the
same latents, text embeddings and timesteps for every variant:

* ``unpatched``: diffusers as it is;
* ``norms exact``: ``ditops.patch(model, precision="exact")`` (fused norm/modulation chain);
* ``sparse 0.5`` / ``sparse 0.75``: norms plus block-sparse self-attention after
  ``skip_first_steps`` dense steps.

Per variant and step: the time of one forward, the speedup over the unpatched model at
that step, and the drift of the output from the unpatched one (max abs, cosine, PSNR).
Also a JSON file and a PNG plot (time per step, per variant).
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

#: The default model: Wan's 1.3B width (12 heads of 128, ffn 8960), fewer layers.
DEFAULT_CONFIG: dict[str, Any] = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 12,
    "attention_head_dim": 128,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 4096,
    "freq_dim": 256,
    "ffn_dim": 8960,
    "num_layers": 2,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "rope_max_seq_len": 1024,
}
#: latent [B, C, F, H, W]: 8 x (64/2) x (64/2) = 8192 video tokens ("small"); "full" doubles F.
LATENTS = {"small": (1, 16, 8, 64, 64), "full": (1, 16, 16, 64, 64)}
STEPS = {"small": 4, "full": 6}
SKIP_FIRST_STEPS = 1
TEXT_TOKENS = 512


@dataclass
class StepResult:
    variant: str
    step: int
    seconds: float
    dense: bool
    max_abs: float
    cosine: float
    psnr: float


def _drift(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float]:
    # float64: an fp32 dot product over a million elements is off by ~1e-5 by itself.
    a, b = out.double().flatten(), ref.double().flatten()
    max_abs = float((a - b).abs().max())
    cosine = float(torch.nn.functional.cosine_similarity(a, b, dim=0))
    mse = float(((a - b) ** 2).mean())
    peak = float(b.abs().max()) or 1.0
    psnr = math.inf if mse == 0 else 10 * math.log10(peak * peak / mse)
    return max_abs, cosine, psnr


def build_model(path: str | None, device: torch.device, dtype: torch.dtype) -> Any:
    from diffusers import WanTransformer3DModel

    if path is None:
        torch.manual_seed(0)
        with torch.device(device):
            model = WanTransformer3DModel(**DEFAULT_CONFIG)
        return model.to(dtype).eval()
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"--model {path!r} is not a directory holding a diffusers checkpoint"
        )
    return (
        WanTransformer3DModel.from_pretrained(path, torch_dtype=dtype, local_files_only=True)
        .to(device)
        .eval()
    )


def _sparse(sparsity: float) -> Any:
    from ditops.attention.schedule import BlockSparseConfig

    return BlockSparseConfig(sparsity=sparsity, skip_first_steps=SKIP_FIRST_STEPS)


def _variants() -> list[tuple[str, dict[str, Any] | None]]:
    return [
        ("unpatched", None),
        ("norms exact", {"precision": "exact"}),
        (
            "sparse 0.5",
            {"precision": "exact", "attention": _sparse(0.5)},
        ),
        (
            "sparse 0.75",
            {"precision": "exact", "attention": _sparse(0.75)},
        ),
    ]


def run(
    device: torch.device,
    size: str,
    *,
    model_path: str | None = None,
    progress: bool = True,
    plot_path: str | None = None,
) -> dict[str, Any]:
    """Run the loop for every variant; returns rows and a summary (see module docstring)."""
    import ditops
    from ditops.bench.harness import Progress, _sync

    dtype = torch.bfloat16
    model = build_model(model_path, device, dtype)
    cfg = model.config
    latent = list(LATENTS[size])
    latent[1] = cfg.in_channels
    gen = torch.Generator(device="cpu").manual_seed(1)
    latents = torch.randn(latent, generator=gen).to(device, dtype)
    text = torch.randn(1, TEXT_TOKENS, cfg.text_dim, generator=gen).to(device, dtype)
    n_steps = STEPS[size]
    timesteps = torch.linspace(999, 0, n_steps).round().to(device)
    variants = _variants()
    bar = Progress(len(variants) * n_steps, "wan", progress)
    reference: dict[int, torch.Tensor] = {}
    results: list[StepResult] = []
    try:
        for name, options in variants:
            ditops.unpatch(model)
            if options is not None:
                ditops.patch(model, **options)
            for i in range(n_steps):
                bar.step(f"{name} step {i}")
                t = timesteps[i : i + 1]
                with (
                    torch.inference_mode(),
                    model.cache_context("cond", step_index=i, num_inference_steps=n_steps),
                ):
                    _sync(device)
                    t0 = time.perf_counter()
                    out = model(
                        hidden_states=latents,
                        timestep=t,
                        encoder_hidden_states=text,
                        return_dict=False,
                    )[0]
                    _sync(device)
                    seconds = time.perf_counter() - t0
                if name == "unpatched":
                    reference[i] = out
                dense = options is None or "attention" not in options or i < SKIP_FIRST_STEPS
                results.append(StepResult(name, i, seconds, dense, *_drift(out, reference[i])))
    finally:
        bar.close()
        ditops.unpatch(model)
    rows = []
    base = {r.step: r.seconds for r in results if r.variant == "unpatched"}
    for r in results:
        rows.append({**r.__dict__, "speedup": base[r.step] / r.seconds})
    summary = _summary(rows, n_steps)
    if plot_path:
        _plot(rows, plot_path)
    return {
        "config": {
            k: (list(v) if isinstance(v, tuple) else v)
            for k, v in dict(cfg).items()
            if not k.startswith("_")
        },
        "latent_shape": latent,
        "video_tokens": latent[2]
        * (latent[3] // cfg.patch_size[1])
        * (latent[4] // cfg.patch_size[2]),
        "steps": n_steps,
        "skip_first_steps": SKIP_FIRST_STEPS,
        "rows": rows,
        "summary": summary,
    }


def _summary(rows: list[dict[str, Any]], n_steps: int) -> list[dict[str, Any]]:
    """Per variant: speedup over all steps (first step excluded: warm-up/compile) and on
    the sparse steps alone, with the worst drift."""
    out = []
    for name in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == name]
        base = {r["step"]: r["seconds"] for r in rows if r["variant"] == "unpatched"}
        sparse_steps = [r for r in mine if not r["dense"]]
        timed = [r for r in mine if r["step"] > 0] or mine
        out.append(
            {
                "variant": name,
                "speedup_per_forward": sum(base[r["step"]] for r in timed)
                / sum(r["seconds"] for r in timed),
                "speedup_sparse_steps": (
                    sum(base[r["step"]] for r in sparse_steps)
                    / sum(r["seconds"] for r in sparse_steps)
                    if sparse_steps
                    else None
                ),
                "max_abs": max(r["max_abs"] for r in mine),
                "min_cosine": min(r["cosine"] for r in mine),
                "min_psnr": min(r["psnr"] for r in mine),
                "bitwise_equal": all(r["max_abs"] == 0 for r in mine),
            }
        )
    return out


def print_report(result: dict[str, Any], out: Any = sys.stdout) -> None:
    print(
        f"\n== wan: {result['video_tokens']} video tokens, latent {result['latent_shape']}, "
        f"{result['config']['num_layers']} layers, {result['steps']} steps "
        f"({result['skip_first_steps']} dense first)",
        file=out,
    )
    print(
        f"{'variant':<13} {'step':>4} {'dense':>5} {'s/forward':>10} {'speedup':>8} {'max abs':>9} "
        f"{'cosine':>9} {'PSNR dB':>8}",
        file=out,
    )
    for r in result["rows"]:
        print(
            f"{r['variant']:<13} {r['step']:>4} {str(r['dense']):>5} {r['seconds']:>10.2f} "
            f"{r['speedup']:>8.2f} {r['max_abs']:>9.2e} {r['cosine']:>9.6f} {r['psnr']:>8.1f}",
            file=out,
        )
    print(
        f"\n{'variant':<13} {'x/forward':>9} {'x sparse steps':>14} {'bitwise':>8} {'min cos':>9} "
        f"{'min PSNR':>9}",
        file=out,
    )
    for s in result["summary"]:
        sparse = "-" if s["speedup_sparse_steps"] is None else f"{s['speedup_sparse_steps']:.2f}"
        print(
            f"{s['variant']:<13} {s['speedup_per_forward']:>9.2f} {sparse:>14} "
            f"{str(s['bitwise_equal']):>8} {s['min_cosine']:>9.6f} {s['min_psnr']:>9.1f}",
            file=out,
        )


def _plot(rows: list[dict[str, Any]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "ditops bench: matplotlib is not installed; no plot (pip install 'ditops[bench]')",
            file=sys.stderr,
        )
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == name]
        ax.plot([r["step"] for r in mine], [r["seconds"] for r in mine], marker="o", label=name)
    ax.axvspan(-0.5, SKIP_FIRST_STEPS - 0.5, color="0.9", label="dense steps")
    ax.set_xlabel("denoising step")
    ax.set_ylabel("seconds per forward")
    ax.set_title("Wan forward time per step: unpatched vs ditops")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
