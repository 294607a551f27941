"""Benchmark suite ``cogvideox`` of ``ditops bench``: a small CogVideoX model end to end.

A ``CogVideoXTransformer3DModel`` (random weights, no download) with CogVideoX-5B's
geometry (head dim 64, patch 2, rotary tables, 226 text tokens first, no text mask), in the
1.0 layout and the 1.5 one (``patch_size_t=2``), runs one forward under each variant
(:data:`~ditops.bench.sparse_video.SPARSE` but the permuted mode: ``unpatched``, ``exact``,
``sparse 0.5`` / ``sparse 0.75``: block-sparse attention for the video queries, text
queries dense, the text and first frame's keys dense), as :mod:`ditops.bench.hunyuan_video`
does.

``size``: ``small`` is 4 heads of 64, one block, 13 token frames of 16 x 24 (4992 video
tokens; 26 latent frames under 1.5); ``full`` is CogVideoX-5B's width (48 heads) at 480 x
720 (13 token frames of 30 x 45, 17550 tokens), for GPUs. ``run``'s ``tokens`` (token
frames, height, width of the video after the patch) replace the size's.
"""

from __future__ import annotations

from typing import Any

import torch

from ditops.bench.model_bench import ModelBench
from ditops.bench.model_runs import sparse_variants
from ditops.bench.sparse_video import SPARSE, SPARSITIES

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


def _inputs(config: dict[str, Any], device: Any, dtype: Any, tokens: Any) -> Any:
    frames, th, tw = tokens
    p, pt = config["patch_size"], config.get("patch_size_t") or 1
    x = make_inputs(config, (frames * pt, th * p, tw * p), device, dtype)
    return x, {"video_tokens": frames * th * tw, "text_tokens": config["max_text_seq_length"]}


BENCH = ModelBench(
    name="cogvideox",
    title="small CogVideoX 1.0 and 1.5 configs",
    model="CogVideoXTransformer3DModel",
    base_config=BASE_CONFIG,
    sizes=SIZES,
    shape=("tokens",),
    inputs=_inputs,
    attentions=lambda model: [b.attn1 for b in model.transformer_blocks],
    headline="cogvideox {layout} ({size}): {video_tokens} video + {text_tokens} text tokens, "
    "{config[num_attention_heads]} heads of {config[attention_head_dim]}, {config[num_layers]} "
    "block(s), {dtype}, blocks of {block_size}, {rounds} interleaved rounds",
    kind=SPARSE,
    variants=lambda block_size: sparse_variants(block_size, SPARSITIES),
    layouts=LAYOUTS,
)
run, print_report, cli = BENCH.run, BENCH.print_report, BENCH.cli
