"""Benchmark suite ``flux`` of ``ditops bench``: a small FLUX model end to end.

A ``FluxTransformer2DModel`` built from keyword arguments (random weights, bf16, no
download) runs the same forward (image latents, text embeddings, pooled embedding,
timestep, position ids) under three variants:

* ``unpatched``: diffusers as it is;
* ``exact``: ``ditops.patch(model, precision="exact")`` (fused adaLN chain and attention
  prologue, bitwise the unpatched model);
* ``fast``: ``ditops.patch(model, precision="fast")`` (rounded once where eager rounds
  several times).

The variants take turns (A, B, C, A, B, C, ...) for ``rounds`` rounds after one untimed
call each, so a slow spell of a shared machine lands on all of them; per variant the
median seconds per forward, the median of the per-round ratios to ``unpatched``, and the
drift of the output from the unpatched one (max abs, max abs relative to the output's
largest magnitude, bitwise equality). The attention modules' share of the time (the
prologue, attention, projections) is timed by forward hooks.

``size`` picks the shape: ``small`` is FLUX's head dim (128) at a sixth of its width
(4 heads), one block of each kind, 576 image and 128 text tokens (its times on a CPU
without AMX, where bf16 matmuls are slow: benchmarks/cpu/flux.txt); ``full`` is
FLUX.1's width (24 heads of 128, [1, 4608, 24, 128] q/k in the prologue) with one block
of each kind. Keyword arguments of :func:`run` override the config.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from ditops.bench.model_runs import (
    ModuleTimer,
    build_seeded,
    interleaved_forwards,
    size_config,
    timing_summary,
)

#: FLUX.1's structure; ``SIZES`` set the width and the token counts.
BASE_CONFIG: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 64,
    "attention_head_dim": 128,
    "pooled_projection_dim": 768,
    "guidance_embeds": False,
    "axes_dims_rope": (16, 56, 56),
}
SIZES: dict[str, dict[str, Any]] = {
    "small": {
        "config": {
            "num_layers": 1,
            "num_single_layers": 1,
            "num_attention_heads": 4,
            "joint_attention_dim": 512,
        },
        "image_side": 24,  # 24 x 24 = 576 image tokens
        "text_tokens": 128,
        "rounds": 3,
    },
    "full": {
        "config": {
            "num_layers": 1,
            "num_single_layers": 1,
            "num_attention_heads": 24,
            "joint_attention_dim": 4096,
        },
        "image_side": 64,  # 4096 image tokens + 512 text: FLUX.1 at 1024 x 1024
        "text_tokens": 512,
        "rounds": 3,
    },
}
VARIANTS: tuple[tuple[str, str | None], ...] = (
    ("unpatched", None),
    ("exact", "exact"),
    ("fast", "fast"),
)


def build_model(device: torch.device, dtype: torch.dtype, **config: Any) -> Any:
    from diffusers import FluxTransformer2DModel

    return build_seeded(FluxTransformer2DModel, device, dtype, config)


def make_inputs(
    config: dict[str, Any], side: int, text_tokens: int, device: torch.device, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cpu").manual_seed(1)
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3).float()
    channels = config["in_channels"] * config["patch_size"] ** 2
    return {
        "hidden_states": torch.randn(1, side * side, channels, generator=gen).to(device, dtype),
        "encoder_hidden_states": torch.randn(
            1, text_tokens, config["joint_attention_dim"], generator=gen
        ).to(device, dtype),
        "pooled_projections": torch.randn(1, config["pooled_projection_dim"], generator=gen).to(
            device, dtype
        ),
        "timestep": torch.tensor([0.75], device=device, dtype=dtype),
        "img_ids": img_ids.to(device),
        "txt_ids": torch.zeros(text_tokens, 3, device=device),
    }


def attention_timer(model: Any, device: torch.device) -> ModuleTimer:
    """Seconds spent inside the model's attention modules during one forward."""
    blocks = list(model.transformer_blocks) + list(model.single_transformer_blocks)
    return ModuleTimer([b.attn for b in blocks], device)


def run(
    device: torch.device,
    size: str = "small",
    *,
    rounds: int | None = None,
    image_side: int | None = None,
    text_tokens: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    progress: bool = True,
    **overrides: Any,
) -> dict[str, Any]:
    """Time every variant, interleaved; returns the config, rows and a summary.

    ``rounds``, ``image_side`` (image tokens: its square) and ``text_tokens`` replace the
    size's; ``overrides`` replace entries of the model config (``num_layers=2``, ...).
    """
    from ditops.integrations import patch, unpatch

    spec, config = size_config("flux", SIZES, size, BASE_CONFIG, overrides)
    rounds = spec["rounds"] if rounds is None else rounds
    side = spec["image_side"] if image_side is None else image_side
    n_text = spec["text_tokens"] if text_tokens is None else text_tokens
    model = build_model(device, dtype, **config)
    x = make_inputs(config, side, n_text, device, dtype)

    def use(precision: str | None) -> None:
        unpatch(model)
        if precision is not None:
            patch(model, precision=precision)

    outputs, times, timers = interleaved_forwards(
        model,
        x,
        device,
        VARIANTS,
        use,
        rounds,
        lambda m: attention_timer(m, device),
        desc="flux",
        progress=progress,
        reset=lambda: unpatch(model),
    )
    attn_times = {name: [t.seconds for t in ts] for name, ts in timers.items()}
    ref = outputs["unpatched"].double()
    peak = float(ref.abs().max()) or 1.0
    summary = []
    for name, _ in VARIANTS:
        diff = float((outputs[name].double() - ref).abs().max())
        summary.append(
            {
                **timing_summary(name, times, attn_times),
                "max_abs": diff,
                "max_rel": diff / peak,
                "bitwise_equal": bool(torch.equal(outputs[name], outputs["unpatched"])),
            }
        )
    return {
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in config.items()},
        "size": size,
        "dtype": str(dtype).replace("torch.", ""),
        "image_tokens": side**2,
        "text_tokens": n_text,
        "rounds": rounds,
        "seconds": times,
        "attention_seconds": attn_times,
        "summary": summary,
    }


def print_report(result: dict[str, Any], out: Any = None) -> None:
    out = sys.stdout if out is None else out
    cfg = result["config"]
    print(
        f"\n== flux ({result['size']}): {result['image_tokens']} image + {result['text_tokens']} "
        f"text tokens, {cfg['num_attention_heads']} heads of {cfg['attention_head_dim']}, "
        f"{cfg['num_layers']} double + {cfg['num_single_layers']} single blocks, "
        f"{result['dtype']}, {result['rounds']} interleaved rounds",
        file=out,
    )
    print(
        f"{'variant':<10} {'s/forward':>10} {'attention s':>12} {'x unpatched':>12} "
        f"{'bitwise':>8} {'max abs':>9} {'max rel':>9}",
        file=out,
    )
    for s in result["summary"]:
        print(
            f"{s['variant']:<10} {s['median_seconds']:>10.3f} "
            f"{s['median_attention_seconds']:>12.3f} "
            f"{s['speedup']:>12.3f} {str(s['bitwise_equal']):>8} {s['max_abs']:>9.2e} "
            f"{s['max_rel']:>9.2e}",
            file=out,
        )
    print("(medians over rounds; x unpatched: median of the per-round ratios)", file=out)


def cli(device: torch.device, size: str, progress: bool) -> dict[str, Any]:
    """``ditops bench flux``: run and print (stderr: what runs; stdout: the report)."""
    print(f"ditops bench: flux (a small FLUX config) on {device}, size {size}", file=sys.stderr)
    result = run(device, size, progress=progress)
    print_report(result)
    return result
