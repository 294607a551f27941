"""Benchmark suite ``hunyuan_video`` of ``ditops bench``: a small HunyuanVideo model end to end.

A ``HunyuanVideoTransformer3DModel`` built from keyword arguments (random weights, no
download) with HunyuanVideo's geometry (head dim 128, patch 2, rope axes (16, 56, 56),
guidance embedding, text last with padding) runs one forward under each variant:

* ``unpatched``: diffusers as it is;
* ``exact``: ``ditops.patch(model, precision="exact")`` (bitwise the unpatched model);
* ``sparse 0.5`` / ``sparse 0.75``: exact norms and block-sparse video self-attention at
  that sparsity (text rows and columns dense, the first frame dense);
* ``sparse 0.75 perm``: the same at 0.75 in the permuted mode
  (``BlockSparseConfig(permute=True)``; this loop has no step index, so each call
  clusters from a cold start: its dearest call).

The variants take turns (A, B, C, D, A, ...) for ``rounds`` rounds after one untimed call
each, so a slow spell of a shared machine lands on all of them; per variant: the median
seconds per forward, the seconds inside the attention modules (forward hooks), the median
of the per-round ratios to ``unpatched`` (whole forward and attention alone), the block
density asked for and realised (the estimator's masks), and the drift of the output from
the unpatched one (max abs relative to its peak, cosine, PSNR).

``size``: ``small`` is 4 heads of 128, one block of each kind, 13 latent frames of 16 x 24
tokens (4992 video tokens) and 64 text tokens (16 padded); ``full`` is HunyuanVideo's
width (24 heads) at 33 latent frames of 30 x 40 tokens (39600), for GPUs. ``dtype`` None:
bf16, or fp32 on a CPU whose bf16 matmuls are a slow fallback.
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
    "in_channels": 16,
    "out_channels": 16,
    "attention_head_dim": 128,
    "patch_size": 2,
    "patch_size_t": 1,
    "rope_axes_dim": (16, 56, 56),
    "guidance_embeds": True,
    "pooled_projection_dim": 768,
    "num_refiner_layers": 1,
}
SIZES: dict[str, dict[str, Any]] = {
    "small": {
        "config": {
            "num_layers": 1,
            "num_single_layers": 1,
            "num_attention_heads": 4,
            "text_embed_dim": 256,
        },
        "latent": (13, 32, 48),  # frames, height, width: 13 x 16 x 24 tokens
        "text_tokens": 64,
        "rounds": 3,
    },
    "full": {
        "config": {
            "num_layers": 1,
            "num_single_layers": 1,
            "num_attention_heads": 24,
            "text_embed_dim": 4096,
        },
        "latent": (33, 60, 80),
        "text_tokens": 256,
        "rounds": 3,
    },
}


def attentions(model: Any) -> list[Any]:
    """Every block's ``attn``, the double-stream blocks' then the single-stream ones'."""
    return [b.attn for b in [*model.transformer_blocks, *model.single_transformer_blocks]]


def build_model(device: torch.device, dtype: torch.dtype, **config: Any) -> Any:
    from diffusers import HunyuanVideoTransformer3DModel

    return build_seeded(HunyuanVideoTransformer3DModel, device, dtype, config)


def make_inputs(
    config: dict[str, Any],
    latent: tuple[int, int, int],
    text_tokens: int,
    device: torch.device,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """Latents, text with its last quarter padded, pooled text, timestep, guidance."""
    gen = torch.Generator(device="cpu").manual_seed(1)
    mask = torch.ones(1, text_tokens, dtype=torch.int64)
    mask[:, text_tokens - text_tokens // 4 :] = 0
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)  # noqa: E731
    return {
        "hidden_states": rand(1, config["in_channels"], *latent),
        "timestep": torch.tensor([900], device=device),
        "encoder_hidden_states": rand(1, text_tokens, config["text_embed_dim"]),
        "encoder_attention_mask": mask.to(device),
        "pooled_projections": rand(1, config["pooled_projection_dim"]),
        "guidance": torch.tensor([6000.0], device=device, dtype=dtype),
    }


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
    """Time every variant, interleaved; returns the config, per-round times and a summary.

    ``rounds``, ``latent`` (frames, height, width of the latent video), ``text_tokens`` and
    ``block_size`` (of the sparse attention) replace the size's; ``overrides`` replace
    entries of the model config.
    """
    spec, config = size_config("hunyuan_video", SIZES, size, BASE_CONFIG, overrides)
    rounds = spec["rounds"] if rounds is None else rounds
    latent = spec["latent"] if latent is None else latent
    n_text = spec["text_tokens"] if text_tokens is None else text_tokens
    dtype = default_dtype(device) if dtype is None else dtype
    model = build_model(device, dtype, **config)
    x = make_inputs(config, latent, n_text, device, dtype)
    variants = sparse_variants(block_size, SPARSITIES, PERMUTED_SPARSITY)
    times, attn, summary = time_variants(
        model, x, device, variants, rounds, attentions, "hunyuan_video", progress
    )
    frames, h, w = latent
    p = config["patch_size"]
    return {
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in config.items()},
        "size": size,
        "dtype": str(dtype).replace("torch.", ""),
        "video_tokens": frames // config["patch_size_t"] * (h // p) * (w // p),
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
        f"\n== hunyuan_video ({result['size']}): {result['video_tokens']} video + "
        f"{result['text_tokens']} text tokens ({result['padded_text_tokens']} padded), "
        f"{cfg['num_attention_heads']} heads of {cfg['attention_head_dim']}, "
        f"{cfg['num_layers']} double + {cfg['num_single_layers']} single blocks, "
        f"{result['dtype']}, blocks of {result['block_size']}, {result['rounds']} "
        "interleaved rounds",
        file=out,
    )
    print_rows(result["summary"], out)


def cli(
    device: torch.device, size: str, progress: bool, dtype: torch.dtype | None = None
) -> dict[str, Any]:
    """``ditops bench hunyuan_video``: run and print (stderr: what runs; stdout: the report)."""
    print(
        f"ditops bench: hunyuan_video (a small HunyuanVideo config) on {device}, size {size}",
        file=sys.stderr,
    )
    result = run(device, size, progress=progress, dtype=dtype)
    print_report(result)
    return result
