"""Benchmark suite ``flux`` of ``ditops bench``: a small FLUX model end to end.

A ``FluxTransformer2DModel`` (random weights, bf16, no download) runs the same forward
(image latents, text embeddings, pooled embedding, timestep, position ids) under
:data:`~ditops.bench.model_bench.PRECISIONS`' variants: ``unpatched`` (diffusers as it
is), ``exact`` (fused adaLN chain and attention prologue, bitwise the unpatched model) and
``fast`` (rounded once where eager rounds several times), in turns
(:mod:`ditops.bench.model_bench`); per variant the seconds per forward and inside the
attention modules (the prologue, attention, projections), the ratios to ``unpatched``, the
drift (max abs, relative to the output's peak, bitwise equality).

``size``: ``small`` is FLUX's head dim (128) at a sixth of its width (4 heads), one block
of each kind, 576 image and 128 text tokens (its times on a CPU without AMX, where bf16
matmuls are slow: benchmarks/cpu/flux.txt); ``full`` is FLUX.1's width (24 heads of 128,
[1, 4608, 24, 128] q/k in the prologue) with one block of each kind. ``run``'s
``image_side`` (image tokens: its square) and ``text_tokens`` replace the size's.
"""

from __future__ import annotations

from typing import Any

import torch

from ditops.bench.model_bench import PRECISIONS, ModelBench

#: FLUX.1's structure; ``SIZES`` set the width and the token counts.
BASE_CONFIG: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 64,
    "attention_head_dim": 128,
    "pooled_projection_dim": 768,
    "guidance_embeds": False,
    "axes_dims_rope": (16, 56, 56),
}
_LAYERS = {"num_layers": 1, "num_single_layers": 1}
SIZES: dict[str, dict[str, Any]] = {
    "small": {
        "config": {**_LAYERS, "num_attention_heads": 4, "joint_attention_dim": 512},
        "image_side": 24,  # 24 x 24 = 576 image tokens
        "text_tokens": 128,
        "rounds": 3,
    },
    "full": {
        "config": {**_LAYERS, "num_attention_heads": 24, "joint_attention_dim": 4096},
        "image_side": 64,  # 4096 image tokens + 512 text: FLUX.1 at 1024 x 1024
        "text_tokens": 512,
        "rounds": 3,
    },
}


def make_inputs(
    config: dict[str, Any], side: int, text_tokens: int, device: torch.device, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cpu").manual_seed(1)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)  # noqa: E731
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3).float()
    return {
        "hidden_states": rand(1, side * side, config["in_channels"] * config["patch_size"] ** 2),
        "encoder_hidden_states": rand(1, text_tokens, config["joint_attention_dim"]),
        "pooled_projections": rand(1, config["pooled_projection_dim"]),
        "timestep": torch.tensor([0.75], device=device, dtype=dtype),
        "img_ids": img_ids.to(device),
        "txt_ids": torch.zeros(text_tokens, 3, device=device),
    }


BENCH = ModelBench(
    name="flux",
    title="a small FLUX config",
    model="FluxTransformer2DModel",
    base_config=BASE_CONFIG,
    sizes=SIZES,
    shape=("image_side", "text_tokens"),
    inputs=lambda config, device, dtype, image_side, text_tokens: (
        make_inputs(config, image_side, text_tokens, device, dtype),
        {"image_tokens": image_side**2, "text_tokens": text_tokens},
    ),
    attentions=lambda m: [b.attn for b in [*m.transformer_blocks, *m.single_transformer_blocks]],
    headline="flux ({size}): {image_tokens} image + {text_tokens} text tokens, "
    "{config[num_attention_heads]} heads of {config[attention_head_dim]}, {config[num_layers]} "
    "double + {config[num_single_layers]} single blocks, {dtype}, {rounds} interleaved rounds",
    kind=PRECISIONS,
)
run, print_report, cli = BENCH.run, BENCH.print_report, BENCH.cli
