"""Benchmark suite ``ltx_video`` of ``ditops bench``: a small LTX-Video model end to end.

An ``LTXVideoTransformer3DModel`` (random weights, no download) with LTX-Video's geometry
(head dim 64, patch 1, RMSNorm blocks, text with padding) runs one forward under each
sparse variant, as :mod:`ditops.bench.hunyuan_video` does; ``attn``: the self-attentions
(``attn1``).

``size``: ``small`` is 8 heads of 64, 2 blocks, 8 latent frames of 16 x 24 tokens (3072
video tokens) and 64 text tokens (16 padded); ``full`` is LTX-Video's width (32 heads of
64) at its 768 x 512, 121-frame latent (16 frames of 16 x 24: 6144 tokens), for GPUs.
``run``'s ``latent`` (frames, height, width) and ``text_tokens`` replace the size's.
"""

from __future__ import annotations

from typing import Any

import torch

from ditops.bench.model_bench import ModelBench
from ditops.bench.sparse_video import SPARSE, padded_text_mask, video_inputs

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
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)  # noqa: E731
    return {
        "hidden_states": rand(1, tokens, config["in_channels"] * p * p * pt),
        "encoder_hidden_states": rand(1, text_tokens, config["caption_channels"]),
        "timestep": torch.tensor([900], device=device),
        "encoder_attention_mask": padded_text_mask(text_tokens).to(device),
        "num_frames": frames,
        "height": h,
        "width": w,
        "rope_interpolation_scale": (8 / 25, 32, 32),  # LTXPipeline's at 25 fps
    }


def self_attentions(model: Any) -> list[Any]:
    return [b.attn1 for b in model.transformer_blocks]


BENCH = ModelBench(
    name="ltx_video",
    title="a small LTX-Video config",
    model="LTXVideoTransformer3DModel",
    base_config=BASE_CONFIG,
    sizes=SIZES,
    shape=("latent", "text_tokens"),
    inputs=video_inputs(make_inputs),
    attentions=self_attentions,
    headline="ltx_video ({size}): {video_tokens} video + {text_tokens} text tokens "
    "({padded_text_tokens} padded), {config[num_attention_heads]} heads of "
    "{config[attention_head_dim]}, {config[num_layers]} blocks, {dtype}, blocks of "
    "{block_size}, {rounds} interleaved rounds; attn: the self-attentions (attn1)",
    kind=SPARSE,
)
run, print_report, cli = BENCH.run, BENCH.print_report, BENCH.cli
