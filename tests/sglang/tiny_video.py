"""A tiny HunyuanVideo checkpoint in diffusers' layout, written at test time (random
weights, fixed seed; the folder is named like the released one so sglang picks its
config). A 1+1-layer transformer (2 heads of 16), a small ``AutoencoderKLHunyuanVideo``,
a 2-layer Llama (its prompt template is long: the word-level tokenizer maps unknown
template words to ``<unk>``, enough tokens for sglang's ``crop_start``) and a CLIP."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.sglang.tiny_images import TEXT_DIM, WORDS, _index, _prefix_keys, _tokenizer


def write_tiny_hunyuan_video(root: Path) -> Path:
    from diffusers import (
        AutoencoderKLHunyuanVideo,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideoTransformer3DModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, LlamaConfig, LlamaModel

    path = root / "HunyuanVideo"
    torch.manual_seed(0)
    HunyuanVideoTransformer3DModel(
        num_attention_heads=2, attention_head_dim=16, num_layers=1, num_single_layers=1,
        num_refiner_layers=1, text_embed_dim=TEXT_DIM, pooled_projection_dim=TEXT_DIM,
        rope_axes_dim=(4, 6, 6),
    ).save_pretrained(path / "transformer")  # fmt: skip
    AutoencoderKLHunyuanVideo(
        block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4,
    ).save_pretrained(path / "vae")  # fmt: skip
    LlamaModel(
        LlamaConfig(
            vocab_size=len(WORDS), hidden_size=TEXT_DIM, intermediate_size=64,
            num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
            max_position_embeddings=512, pad_token_id=0, eos_token_id=1,
        )
    ).save_pretrained(path / "text_encoder")  # fmt: skip
    CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(WORDS), hidden_size=TEXT_DIM, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=77,
            projection_dim=TEXT_DIM, pad_token_id=0, bos_token_id=1, eos_token_id=1,
        )
    ).save_pretrained(path / "text_encoder_2")  # fmt: skip
    _prefix_keys(path / "text_encoder_2", "text_model.")
    _tokenizer(path / "tokenizer", model_max_length=256)
    _tokenizer(path / "tokenizer_2", model_max_length=77)
    FlowMatchEulerDiscreteScheduler(shift=7.0).save_pretrained(path / "scheduler")
    return _index(path, "HunyuanVideoPipeline", {
        "transformer": ["diffusers", "HunyuanVideoTransformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLHunyuanVideo"],
        "text_encoder": ["transformers", "LlamaModel"],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        "text_encoder_2": ["transformers", "CLIPTextModel"],
        "tokenizer_2": ["transformers", "PreTrainedTokenizerFast"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    })  # fmt: skip
