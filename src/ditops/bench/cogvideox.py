"""Benchmark suite ``cogvideox`` of ``ditops bench``: a small CogVideoX model end to end.

A ``CogVideoXTransformer3DModel`` built from keyword arguments (random weights, no
download) with CogVideoX-5B's geometry (head dim 64, patch 2, rotary tables, 226 text
tokens first, no text mask), in the 1.0 layout and the 1.5 one (``patch_size_t=2``),
runs one forward under each variant:

* ``unpatched``: diffusers as it is;
* ``exact``: ``ditops.patch(model, precision="exact")`` (bitwise the unpatched model);
* ``sparse 0.5`` / ``sparse 0.75``: exact norms and block-sparse attention for the video
  queries at that sparsity (text queries dense, the text and first frame's keys dense).

The variants take turns for ``rounds`` rounds after one untimed call each (see
:func:`ditops.bench.model_runs.interleaved_forwards`); per variant (HunyuanVideo's
bench's summary and table): the median seconds
per forward and inside the attention modules, the median per-round ratios to
``unpatched``, the block density asked and realised, and the drift of the output from the
unpatched one (max abs relative to its peak, cosine, PSNR).

``size``: ``small`` is 4 heads of 64, one block, 13 token frames of 16 x 24 (4992 video
tokens; 26 latent frames under 1.5); ``full`` is CogVideoX-5B's width (48 heads) at 480 x
720 (13 token frames of 30 x 45, 17550 tokens), for GPUs. ``dtype`` None: bf16, or fp32
on a CPU whose bf16 matmuls are a slow fallback.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from ditops.bench.model_runs import build_seeded, size_config, sparse_variants
from ditops.bench.sparse_video import (
    SPARSITIES,
    default_dtype,
    print_rows,
    time_variants,
)

BASE_CONFIG: dict[str, Any] = {
    "attention_head_dim": 64,
    "in_channels": 16,
    "out_channels": 16,
    "time_embed_dim": 512,
    "patch_size": 2,
    "max_text_seq_length": 226,
    "use_rotary_positional_embeddings": True,
}
#: What the 1.5 layout changes (CogVideoX1.5-5B: temporal patches, no patch bias).
LAYOUTS: dict[str, dict[str, Any]] = {"1.0": {}, "1.5": {"patch_size_t": 2, "patch_bias": False}}
SIZES: dict[str, dict[str, Any]] = {
    "small": {
        "config": {"num_layers": 1, "num_attention_heads": 4, "text_embed_dim": 256},
        "tokens": (13, 16, 24),  # token frames, height, width after the patch
        "rounds": 3,
    },
    "full": {
        "config": {"num_layers": 1, "num_attention_heads": 48, "text_embed_dim": 4096},
        "tokens": (13, 30, 45),
        "rounds": 3,
    },
}


def build_model(device: torch.device, dtype: torch.dtype, **config: Any) -> Any:
    from diffusers import CogVideoXTransformer3DModel

    return build_seeded(CogVideoXTransformer3DModel, device, dtype, config)


def make_inputs(
    config: dict[str, Any], latent: tuple[int, int, int], device: torch.device, dtype: torch.dtype
) -> dict[str, Any]:
    """Latents ``[1, frames, C, H, W]``, 226 text tokens, timestep and the rotary tables
    (``get_3d_rotary_pos_embed`` over the token grid, as the pipeline makes them)."""
    from diffusers.models.embeddings import get_3d_rotary_pos_embed

    gen = torch.Generator(device="cpu").manual_seed(1)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)  # noqa: E731
    frames, h, w = latent
    p, pt = config["patch_size"], config.get("patch_size_t") or 1
    grid = (h // p, w // p)
    cos, sin = get_3d_rotary_pos_embed(
        config["attention_head_dim"], ((0, 0), grid), grid, frames // pt
    )
    return {
        "hidden_states": rand(1, frames, config["in_channels"], h, w),
        "encoder_hidden_states": rand(1, config["max_text_seq_length"], config["text_embed_dim"]),
        "timestep": torch.tensor([900], device=device),
        "image_rotary_emb": (cos.to(device), sin.to(device)),
    }


def self_attentions(model: Any) -> list[Any]:
    return [b.attn1 for b in model.transformer_blocks]


def run(
    device: torch.device,
    size: str = "small",
    layout: str = "1.0",
    *,
    rounds: int | None = None,
    tokens: tuple[int, int, int] | None = None,
    block_size: int = 128,
    dtype: torch.dtype | None = None,
    progress: bool = True,
    **overrides: Any,
) -> dict[str, Any]:
    """Time every variant, interleaved; returns the config, per-round times and a summary.

    ``rounds`` and ``tokens`` (token frames, height, width of the video after the patch)
    replace the size's; ``overrides`` replace entries of the model config.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"cogvideox bench: layout must be one of {sorted(LAYOUTS)}")
    spec, config = size_config(
        "cogvideox", SIZES, size, BASE_CONFIG, {**LAYOUTS[layout], **overrides}
    )
    rounds = spec["rounds"] if rounds is None else rounds
    frames, th, tw = spec["tokens"] if tokens is None else tokens
    p, pt = config["patch_size"], config.get("patch_size_t") or 1
    latent = (frames * pt, th * p, tw * p)
    dtype = default_dtype(device) if dtype is None else dtype
    model = build_model(device, dtype, **config)
    x = make_inputs(config, latent, device, dtype)
    variants = sparse_variants(block_size, SPARSITIES)

    times, attn, summary = time_variants(
        model, x, device, variants, rounds, self_attentions, f"cogvideox {layout}", progress
    )
    return {
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in config.items()},
        "size": size,
        "layout": layout,
        "dtype": str(dtype).replace("torch.", ""),
        "video_tokens": frames * th * tw,
        "text_tokens": config["max_text_seq_length"],
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
        f"\n== cogvideox {result['layout']} ({result['size']}): {result['video_tokens']} video "
        f"+ {result['text_tokens']} text tokens, {cfg['num_attention_heads']} heads of "
        f"{cfg['attention_head_dim']}, {cfg['num_layers']} block(s), {result['dtype']}, "
        f"blocks of {result['block_size']}, {result['rounds']} interleaved rounds",
        file=out,
    )
    print_rows(result["summary"], out)


def cli(
    device: torch.device, size: str, progress: bool, dtype: torch.dtype | None = None
) -> dict[str, Any]:
    """``ditops bench cogvideox``: both layouts, run and printed (stderr: what runs; stdout:
    the report)."""
    print(
        f"ditops bench: cogvideox (small CogVideoX 1.0 and 1.5 configs) on {device}, size {size}",
        file=sys.stderr,
    )
    results = {}
    for layout in LAYOUTS:
        results[layout] = run(device, size, layout, progress=progress, dtype=dtype)
        print_report(results[layout])
    return results
