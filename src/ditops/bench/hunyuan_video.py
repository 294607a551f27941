"""Benchmark suite ``hunyuan_video`` of ``ditops bench``: a small HunyuanVideo model end to end.

A ``HunyuanVideoTransformer3DModel`` (random weights, no download) with HunyuanVideo's
geometry (head dim 128, patch 2, rope axes (16, 56, 56), guidance embedding, text last with
padding) runs one forward under each sparse variant (:data:`~ditops.bench.sparse_video.SPARSE`:
``unpatched``, ``exact`` (bitwise the unpatched model), ``sparse 0.5`` / ``sparse 0.75``
(block-sparse video self-attention, text rows and columns and the first frame dense) and
``sparse 0.75 perm`` (the permuted mode; no step index here, so each call clusters from a
cold start: its dearest call)), in turns (:mod:`ditops.bench.model_bench`); per variant the
seconds per forward and inside every block's ``attn``, the ratios to ``unpatched``, the
block density asked and realised, the drift (max relative, cosine, PSNR).

``size``: ``small`` is 4 heads of 128, one block of each kind, 13 latent frames of 16 x 24
tokens (4992 video tokens) and 64 text tokens (16 padded); ``full`` is HunyuanVideo's width
(24 heads) at 33 latent frames of 30 x 40 tokens (39600), for GPUs. ``run``'s ``latent``
(frames, height, width of the latent video) and ``text_tokens`` replace the size's.
"""

from __future__ import annotations

from typing import Any

import torch

from ditops.bench.model_bench import ModelBench
from ditops.bench.sparse_video import SPARSE, padded_text_mask, video_inputs

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
_LAYERS = {"num_layers": 1, "num_single_layers": 1}
SIZES: dict[str, dict[str, Any]] = {
    "small": {
        "config": {**_LAYERS, "num_attention_heads": 4, "text_embed_dim": 256},
        "latent": (13, 32, 48),  # frames, height, width: 13 x 16 x 24 tokens
        "text_tokens": 64,
        "rounds": 3,
    },
    "full": {
        "config": {**_LAYERS, "num_attention_heads": 24, "text_embed_dim": 4096},
        "latent": (33, 60, 80),
        "text_tokens": 256,
        "rounds": 3,
    },
}


def attentions(model: Any) -> list[Any]:
    """Every block's ``attn``, the double-stream blocks' then the single-stream ones'."""
    return [b.attn for b in [*model.transformer_blocks, *model.single_transformer_blocks]]


def make_inputs(
    config: dict[str, Any],
    latent: tuple[int, int, int],
    text_tokens: int,
    device: torch.device,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """Latents, text with its last quarter padded, pooled text, timestep, guidance."""
    gen = torch.Generator(device="cpu").manual_seed(1)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)  # noqa: E731
    return {
        "hidden_states": rand(1, config["in_channels"], *latent),
        "timestep": torch.tensor([900], device=device),
        "encoder_hidden_states": rand(1, text_tokens, config["text_embed_dim"]),
        "encoder_attention_mask": padded_text_mask(text_tokens).to(device),
        "pooled_projections": rand(1, config["pooled_projection_dim"]),
        "guidance": torch.tensor([6000.0], device=device, dtype=dtype),
    }


BENCH = ModelBench(
    name="hunyuan_video",
    title="a small HunyuanVideo config",
    model="HunyuanVideoTransformer3DModel",
    base_config=BASE_CONFIG,
    sizes=SIZES,
    shape=("latent", "text_tokens"),
    inputs=video_inputs(make_inputs),
    attentions=attentions,
    headline="hunyuan_video ({size}): {video_tokens} video + {text_tokens} text tokens "
    "({padded_text_tokens} padded), {config[num_attention_heads]} heads of "
    "{config[attention_head_dim]}, {config[num_layers]} double + {config[num_single_layers]} "
    "single blocks, {dtype}, blocks of {block_size}, {rounds} interleaved rounds",
    kind=SPARSE,
)
run, print_report, cli = BENCH.run, BENCH.print_report, BENCH.cli
