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

import importlib.util
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
#: Calls timed per step and variant (the fastest is kept).
REPEATS = 2
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
    sections: dict[str, float]


#: Where a forward's time goes: sub-modules of every block, timed by forward hooks; the
#: rest (patch embedding, norms, modulation, residuals, output) is the remainder.
SECTIONS = {"attn1": "self-attention", "attn2": "cross-attention", "ffn": "feed-forward"}


class _SectionTimer:
    """Wall time spent inside each block's attn1 / attn2 / ffn during a ``with`` block."""

    def __init__(self, model: Any, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.seconds = {label: 0.0 for label in SECTIONS.values()}
        self._handles: list[Any] = []

    def __enter__(self) -> _SectionTimer:
        from ditops.bench.harness import _sync

        for block in self.model.blocks:
            for attr, label in SECTIONS.items():
                module = getattr(block, attr)
                start: list[float] = []

                def pre(_m: Any, _a: Any, start: list[float] = start) -> None:
                    _sync(self.device)
                    start.append(time.perf_counter())

                def post(
                    _m: Any, _a: Any, _o: Any, start: list[float] = start, label: str = label
                ) -> None:
                    _sync(self.device)
                    self.seconds[label] += time.perf_counter() - start.pop()

                self._handles.append(module.register_forward_pre_hook(pre))
                self._handles.append(module.register_forward_hook(post))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()


def _forward(
    model: Any,
    latents: torch.Tensor,
    timesteps: torch.Tensor,
    text: torch.Tensor,
    step: int,
    n_steps: int,
    device: torch.device,
) -> tuple[torch.Tensor, float]:
    """One denoiser call at ``step``, inside the cache context a diffusers pipeline sets."""
    from ditops.bench.harness import _sync

    with (
        torch.inference_mode(),
        model.cache_context("cond", step_index=step, num_inference_steps=n_steps),
    ):
        _sync(device)
        t0 = time.perf_counter()
        out = model(
            hidden_states=latents,
            timestep=timesteps[step : step + 1],
            encoder_hidden_states=text,
            return_dict=False,
        )[0]
        _sync(device)
        return out, time.perf_counter() - t0


def _drift(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float]:
    # float64: an fp32 dot product over a million elements is off by ~1e-5 by itself.
    a, b = out.double().flatten(), ref.double().flatten()
    max_abs = float((a - b).abs().max())
    cosine = float(torch.nn.functional.cosine_similarity(a, b, dim=0))
    mse = float(((a - b) ** 2).mean())
    peak = float(b.abs().max()) or 1.0
    psnr = math.inf if mse == 0 else 10 * math.log10(peak * peak / mse)
    return max_abs, cosine, psnr


def cast_like_from_pretrained(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Cast ``model`` to ``dtype`` the way ``from_pretrained(torch_dtype=dtype)`` loads it.

    Floating parameters and persistent buffers go to ``dtype``, except those whose dotted
    name holds one of the model's ``_keep_in_fp32_modules`` (Wan: norms, the time
    embedder, the modulation tables), which stay fp32. ``model.to(dtype)`` would cast
    those too (diffusers warns that results then differ from the checkpoint's).
    """
    keep = list(getattr(model, "_keep_in_fp32_modules", None) or [])
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            if t.is_floating_point():
                fp32 = any(k in name.split(".") for k in keep)
                t.data = t.data.to(torch.float32 if fp32 else dtype)
    return model


class ModelLoadError(RuntimeError):
    """``--model PATH`` could not be loaded; the message says why in one line."""


def build_model(path: str | None, device: torch.device, dtype: torch.dtype) -> Any:
    from diffusers import WanTransformer3DModel

    if path is None:
        torch.manual_seed(0)
        with torch.device(device):
            model = WanTransformer3DModel(**DEFAULT_CONFIG)
        return cast_like_from_pretrained(model, dtype).eval()
    if not os.path.isdir(path):
        raise ModelLoadError(f"--model {path!r} is not a directory holding a diffusers checkpoint")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelLoadError(
            f"--model {path!r} has no config.json: not a diffusers model folder (for a "
            "pipeline folder, pass its transformer/ subfolder)"
        )
    if importlib.util.find_spec("accelerate") is None:
        # diffusers loads Wan's fp32 modules with low_cpu_mem_usage, which needs accelerate
        # (without it: a ValueError about low_cpu_mem_usage after a long warning).
        raise ModelLoadError(
            f"loading --model {path!r} needs accelerate: pip install accelerate "
            "(or pip install 'ditops[bench]')"
        )
    try:
        model = WanTransformer3DModel.from_pretrained(
            path, torch_dtype=dtype, local_files_only=True
        )
    except (OSError, ValueError, KeyError, ImportError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"--model {path!r} could not be loaded: {first}") from exc
    return model.to(device).eval()


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
    from ditops.bench.harness import Progress
    from ditops.integrations import patch, unpatch

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
    warmups: dict[str, float] = {}

    def use(options: dict[str, Any] | None) -> None:
        unpatch(model)
        if options is not None:
            patch(model, **options)

    try:
        for name, options in variants:
            # One untimed call at the last (sparse, where there are any) step: compiles
            # (FlexAttention) and first-touch allocations stay out of the step times.
            use(options)
            warmups[name] = _forward(model, latents, timesteps, text, n_steps - 1, n_steps, device)[
                1
            ]
        for i in range(n_steps):
            # Variants take turns at every step, so a slow spell of a shared machine
            # lands on all of them rather than on one.
            for name, options in variants:
                bar.step(f"{name} step {i}")
                use(options)
                # The faster of REPEATS calls: one noisy call moves a forward by 10%.
                timings = []
                for _ in range(REPEATS):
                    with _SectionTimer(model, device) as sections:
                        out, seconds = _forward(model, latents, timesteps, text, i, n_steps, device)
                    timings.append((seconds, sections.seconds))
                seconds, section_seconds = min(timings, key=lambda t: t[0])
                if name == "unpatched":
                    reference[i] = out
                dense = options is None or "attention" not in options or i < SKIP_FIRST_STEPS
                drift = _drift(out, reference[i])
                results.append(StepResult(name, i, seconds, dense, *drift, section_seconds))
    finally:
        bar.close()
        unpatch(model)
    results.sort(key=lambda r: [v for v, _ in variants].index(r.variant))
    rows = []
    base = {r.step: r.seconds for r in results if r.variant == "unpatched"}
    for r in results:
        rows.append({**r.__dict__, "speedup": base[r.step] / r.seconds})
    summary = _summary(rows, n_steps)
    if plot_path:
        _plot(rows, summary, plot_path)
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
        "warmup_seconds": warmups,
        "rows": rows,
        "summary": summary,
    }


def _summary(rows: list[dict[str, Any]], n_steps: int) -> list[dict[str, Any]]:
    """Per variant: speedup over all steps and over the sparse steps alone (after an
    untimed warm-up call), the worst drift, and the mean time per section."""
    out = []
    for name in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == name]
        base = {r["step"]: r["seconds"] for r in rows if r["variant"] == "unpatched"}
        sparse_steps = [r for r in mine if not r["dense"]]
        timed = mine
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
                "mean_sections": {
                    label: sum(r["sections"][label] for r in mine) / len(mine)
                    for label in SECTIONS.values()
                },
                "mean_seconds": sum(r["seconds"] for r in mine) / len(mine),
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
    print("\nwhere the time goes (mean seconds per forward):", file=out)
    for s in result["summary"]:
        parts = ", ".join(f"{k} {v:.2f}" for k, v in s["mean_sections"].items())
        rest = s["mean_seconds"] - sum(s["mean_sections"].values())
        print(f"  {s['variant']:<13} {parts}, rest {rest:.2f}", file=out)
    warm = ", ".join(f"{k} {v:.1f} s" for k, v in result["warmup_seconds"].items())
    print(f"untimed warm-up call per variant (compiles included): {warm}", file=out)


def _plot(rows: list[dict[str, Any]], summary: list[dict[str, Any]], path: str) -> None:
    """Left: time per step and variant. Right: where a forward's time goes, per variant."""
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
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == name]
        ax.plot([r["step"] for r in mine], [r["seconds"] for r in mine], marker="o", label=name)
    ax.axvspan(-0.5, SKIP_FIRST_STEPS - 0.5, color="0.9", label="dense steps")
    ax.set_xlabel("denoising step")
    ax.set_ylabel("seconds per forward")
    ax.set_title("Time per step")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    names = [s["variant"] for s in summary]
    bottom = [0.0] * len(names)
    labels = [*SECTIONS.values(), "norms, modulation, rest"]
    for label in labels:
        if label in SECTIONS.values():
            values = [s["mean_sections"][label] for s in summary]
        else:
            values = [s["mean_seconds"] - sum(s["mean_sections"].values()) for s in summary]
        bx.bar(names, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    bx.set_ylabel("mean seconds per forward")
    bx.set_title("Where the time goes")
    bx.legend(fontsize=8)
    fig.suptitle("Wan forward, unpatched vs ditops (ditops bench)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
