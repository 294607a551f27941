"""Benchmark suite ``ltx_video`` of ``ditops bench``: a small LTX-Video model end to end.

An ``LTXVideoTransformer3DModel`` built from keyword arguments (random weights, no
download) with LTX-Video's geometry (head dim 64, patch 1, RMSNorm blocks, text with
padding) runs one forward under each variant, as :mod:`ditops.bench.hunyuan_video` does:
``unpatched``, ``exact`` (bitwise the unpatched model), ``sparse 0.5`` / ``sparse 0.75``
(exact norms and block-sparse self-attention, the first frame dense) and ``sparse 0.75
perm`` (the permuted mode), in turns for ``rounds`` rounds after one untimed call each; per
variant the median seconds per forward and inside the self-attentions (``attn1``), the
per-round ratios to ``unpatched``, the density asked and run, the drift (max relative,
cosine, PSNR).

``size``: ``small`` is 8 heads of 64, 2 blocks, 8 latent frames of 16 x 24 tokens (3072
video tokens) and 64 text tokens (16 padded); ``full`` is LTX-Video's width (32 heads of
64) at its 768 x 512, 121-frame latent (16 frames of 16 x 24: 6144 tokens), for GPUs.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from ditops.bench.model_runs import build_seeded, size_config, sparse_variants
from ditops.bench.sparse_video import (
    PERMUTED_SPARSITY,
    SPARSITIES,
    default_dtype,
    print_rows,
    time_variants,
)

BASE_CONFIG: dict[str, Any] = {
    "in_channels": 128,
    "out_channels": 128,
    "patch_size": 1,
    "patch_size_t": 1,
    "attention_head_dim": 64,
}
SIZES: dict[str, dict[str, Any]] = {
    "small": {
        "config": {
            "num_layers": 2,
            "num_attention_heads": 8,
            "cross_attention_dim": 512,
            "caption_channels": 256,
        },
        "latent": (8, 16, 24),  # frames, height, width (patch 1: tokens)
        "text_tokens": 64,
        "rounds": 3,
    },
    "full": {
        "config": {
            "num_layers": 2,
            "num_attention_heads": 32,
            "cross_attention_dim": 2048,
            "caption_channels": 4096,
        },
        "latent": (16, 16, 24),
        "text_tokens": 128,
        "rounds": 3,
    },
}


def build_model(device: torch.device, dtype: torch.dtype, **config: Any) -> Any:
    from diffusers import LTXVideoTransformer3DModel

    return build_seeded(LTXVideoTransformer3DModel, device, dtype, config)


def make_inputs(
    config: dict[str, Any],
    latent: tuple[int, int, int],
    text_tokens: int,
    device: torch.device,
    dtype: torch.dtype,
) -> dict[str, Any]:
    """Packed latents (``(frame, height, width)`` token order, as LTXPipeline packs them),
    the grid, text with its last quarter padded, the timestep."""
    gen = torch.Generator(device="cpu").manual_seed(1)
    frames, h, w = latent
    p, pt = config["patch_size"], config["patch_size_t"]
    tokens = (frames // pt) * (h // p) * (w // p)
    mask = torch.ones(1, text_tokens, dtype=torch.int64)
    mask[:, text_tokens - text_tokens // 4 :] = 0
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)  # noqa: E731
    return {
        "hidden_states": rand(1, tokens, config["in_channels"] * p * p * pt),
        "encoder_hidden_states": rand(1, text_tokens, config["caption_channels"]),
        "timestep": torch.tensor([900], device=device),
        "encoder_attention_mask": mask.to(device),
        "num_frames": frames,
        "height": h,
        "width": w,
        "rope_interpolation_scale": (8 / 25, 32, 32),  # LTXPipeline's at 25 fps
    }


def self_attentions(model: Any) -> list[Any]:
    return [b.attn1 for b in model.transformer_blocks]


def run(
    device: torch.device,
    size: str = "small",
    *,
    rounds: int | None = None,
    latent: tuple[int, int, int] | None = None,
    text_tokens: int | None = None,
    block_size: int = 128,
    dtype: torch.dtype | None = None,
    progress: bool = True,
    **overrides: Any,
) -> dict[str, Any]:
    """Time every variant, interleaved; returns the config, per-round times and a summary
    (arguments as :func:`ditops.bench.hunyuan_video.run`)."""
    spec, config = size_config("ltx_video", SIZES, size, BASE_CONFIG, overrides)
    rounds = spec["rounds"] if rounds is None else rounds
    latent = spec["latent"] if latent is None else latent
    n_text = spec["text_tokens"] if text_tokens is None else text_tokens
    dtype = default_dtype(device) if dtype is None else dtype
    model = build_model(device, dtype, **config)
    x = make_inputs(config, latent, n_text, device, dtype)
    variants = sparse_variants(block_size, SPARSITIES, PERMUTED_SPARSITY)

    times, attn, summary = time_variants(
        model, x, device, variants, rounds, self_attentions, "ltx_video", progress
    )
    return {
        "config": dict(config),
        "size": size,
        "dtype": str(dtype).replace("torch.", ""),
        "video_tokens": int(x["hidden_states"].shape[1]),
        "text_tokens": n_text,
        "padded_text_tokens": n_text // 4,
        "block_size": block_size,
        "rounds": rounds,
        "seconds": times,
        "attention_seconds": attn,
        "summary": summary,
    }


def print_report(result: dict[str, Any], out: Any = None) -> None:
    out = sys.stdout if out is None else out
    cfg = result["config"]
    print(
        f"\n== ltx_video ({result['size']}): {result['video_tokens']} video + "
        f"{result['text_tokens']} text tokens ({result['padded_text_tokens']} padded), "
        f"{cfg['num_attention_heads']} heads of {cfg['attention_head_dim']}, "
        f"{cfg['num_layers']} blocks, {result['dtype']}, blocks of {result['block_size']}, "
        f"{result['rounds']} interleaved rounds; attn: the self-attentions (attn1)",
        file=out,
    )
    print_rows(result["summary"], out)


def cli(
    device: torch.device, size: str, progress: bool, dtype: torch.dtype | None = None
) -> dict[str, Any]:
    """``ditops bench ltx_video``: run and print (stderr: what runs; stdout: the report)."""
    print(
        f"ditops bench: ltx_video (a small LTX-Video config) on {device}, size {size}",
        file=sys.stderr,
    )
    result = run(device, size, progress=progress, dtype=dtype)
    print_report(result)
    return result
