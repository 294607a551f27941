"""Tiny FLUX.1, FLUX.2-klein, Z-Image and Qwen-Image checkpoints in diffusers' layout,
written at test time (random weights, fixed seed; a folder named like the real one picks
sglang's pipeline config).

FLUX.1 and Z-Image are the image pipelines stock sglang runs on a CPU: they are the
baseline of the stock-vs-ditops comparison. Each writes in a few seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.sglang.tiny_wan import WORDS

__all__ = [
    "TEXT_DIM", "WORDS", "write_tiny_flux", "write_tiny_flux2_klein", "write_tiny_qwen_image",
    "write_tiny_zimage",
]  # fmt: skip

TEXT_DIM = 32


def _tokenizer(path: Path, **extra: object) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    word_level = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=word_level, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
        **extra,
    )  # fmt: skip
    tok.save_pretrained(path)


def _flux_vae(path: Path) -> None:
    from diffusers import AutoencoderKL

    AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=16,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4,
        scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
        use_post_quant_conv=False,
    ).save_pretrained(path)  # fmt: skip


def _scheduler(path: Path) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler

    FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    ).save_pretrained(path)  # fmt: skip


def _prefix_keys(folder: Path, prefix: str) -> None:
    """transformers 5 saves CLIP's text model without its ``text_model.`` prefix; released
    checkpoints (and sglang's loader) have it."""
    from safetensors.torch import load_file, save_file

    file = folder / "model.safetensors"
    save_file({prefix + k: v for k, v in load_file(file).items()}, file, metadata={"format": "pt"})


def _add_config(folder: Path, **keys: object) -> None:
    """Keys sglang's arch config reads under its own names (the released config has the
    defaults those names carry, a tiny one does not)."""
    file = folder / "config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **keys}, indent=1))


def _index(path: Path, name: str, parts: dict[str, list[str]]) -> Path:
    index = {"_class_name": name, "_diffusers_version": "0.37.0", **parts}
    (path / "model_index.json").write_text(json.dumps(index, indent=1))
    return path


def write_tiny_flux(root: Path) -> Path:
    """FLUX.1-dev: a 1+1-layer transformer (2 heads of 16), CLIP and T5 of width 32."""
    from diffusers import FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    path = root / "FLUX.1-dev"
    torch.manual_seed(0)
    FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=TEXT_DIM, pooled_projection_dim=TEXT_DIM,
        guidance_embeds=True, axes_dims_rope=(4, 6, 6),
    ).save_pretrained(path / "transformer")  # fmt: skip
    _flux_vae(path / "vae")
    CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(WORDS), hidden_size=TEXT_DIM, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=77,
            projection_dim=TEXT_DIM, pad_token_id=0, bos_token_id=1, eos_token_id=1,
        )
    ).save_pretrained(path / "text_encoder")  # fmt: skip
    _prefix_keys(path / "text_encoder", "text_model.")
    T5EncoderModel(
        T5Config(
            vocab_size=len(WORDS), d_model=TEXT_DIM, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1,
        )
    ).save_pretrained(path / "text_encoder_2")  # fmt: skip
    _tokenizer(path / "tokenizer", model_max_length=77)
    _tokenizer(path / "tokenizer_2", model_max_length=512)
    _scheduler(path / "scheduler")
    return _index(path, "FluxPipeline", {
        "transformer": ["diffusers", "FluxTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        "text_encoder_2": ["transformers", "T5EncoderModel"],
        "tokenizer_2": ["transformers", "PreTrainedTokenizerFast"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    })  # fmt: skip


def write_tiny_zimage(root: Path) -> Path:
    """Z-Image-Turbo: a 1-layer transformer (dim 64, 2 heads), a 2-layer Qwen3 of width 32."""
    from diffusers import ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = root / "Z-Image-Turbo"
    torch.manual_seed(0)
    ZImageTransformer2DModel(
        in_channels=16, dim=64, n_layers=1, n_refiner_layers=1, n_heads=2, n_kv_heads=2,
        cap_feat_dim=TEXT_DIM, axes_dims=[8, 12, 12], axes_lens=[64, 64, 64],
    ).save_pretrained(path / "transformer")  # fmt: skip
    _add_config(path / "transformer", num_layers=1, num_attention_heads=2)
    _flux_vae(path / "vae")
    Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=len(WORDS), hidden_size=TEXT_DIM, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=512, pad_token_id=0, eos_token_id=1,
        )
    ).save_pretrained(path / "text_encoder")  # fmt: skip
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    _tokenizer(path / "tokenizer", model_max_length=512, chat_template=template)
    _scheduler(path / "scheduler")
    return _index(path, "ZImagePipeline", {
        "transformer": ["diffusers", "ZImageTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"],
        "text_encoder": ["transformers", "Qwen3ForCausalLM"],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    })  # fmt: skip


def write_tiny_flux2_klein(root: Path) -> Path:
    """FLUX.2-klein-4B (FLUX.2's transformer, 0.5.21's FLUX.2 with a Qwen3 text encoder;
    FLUX.2-dev's is Mistral-3): a 1+1-layer transformer (2 heads of 16), a small
    ``AutoencoderKLFlux2``, a Qwen3 of width 32 with the 28 layers whose hidden states 9, 18
    and 27 sglang stacks into the text stream."""
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = root / "FLUX.2-klein-4B"
    torch.manual_seed(0)
    Flux2Transformer2DModel(
        patch_size=1, in_channels=128, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=3 * TEXT_DIM, timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False,
    ).save_pretrained(path / "transformer")  # fmt: skip
    AutoencoderKLFlux2(
        block_out_channels=(8, 8, 8, 8), layers_per_block=1, latent_channels=32, norm_num_groups=4
    ).save_pretrained(path / "vae")
    Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=len(WORDS), hidden_size=TEXT_DIM, intermediate_size=64,
            num_hidden_layers=28, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=1024, pad_token_id=0, eos_token_id=1,
        )
    ).save_pretrained(path / "text_encoder")  # fmt: skip
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    _tokenizer(path / "tokenizer", model_max_length=512, chat_template=template)
    _scheduler(path / "scheduler")
    return _index(path, "Flux2KleinPipeline", {
        "transformer": ["diffusers", "Flux2Transformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLFlux2"],
        "text_encoder": ["transformers", "Qwen3ForCausalLM"],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    })  # fmt: skip


def write_tiny_qwen_image(root: Path) -> Path:
    """Qwen-Image: a 1-layer transformer (2 heads of 16), a small ``AutoencoderKLQwenImage``,
    a 2-layer Qwen2.5-VL of width 32 (sglang's own Qwen2.5-VL class needs vllm; without it
    sglang's loader takes transformers' class, as it logs)."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    path = root / "Qwen-Image"
    torch.manual_seed(0)
    QwenImageTransformer2DModel(
        patch_size=2, in_channels=64, out_channels=16, num_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=TEXT_DIM, axes_dims_rope=(4, 6, 6),
    ).save_pretrained(path / "transformer")  # fmt: skip
    AutoencoderKLQwenImage(
        base_dim=16, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
        temperal_downsample=[False, True, True],
    ).save_pretrained(path / "vae")  # fmt: skip
    text = dict(
        vocab_size=len(WORDS), hidden_size=TEXT_DIM, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
        rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, pad_token_id=0,
        eos_token_id=1,
    )  # fmt: skip
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                  out_hidden_size=TEXT_DIM, fullatt_block_indexes=[0])  # fmt: skip
    config = Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, vocab_size=len(WORDS), image_token_id=3,
        video_token_id=4, vision_start_token_id=5,
    )  # fmt: skip
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(path / "text_encoder")
    _tokenizer(path / "tokenizer", model_max_length=1024)
    _scheduler(path / "scheduler")
    return _index(path, "QwenImagePipeline", {
        "transformer": ["diffusers", "QwenImageTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLQwenImage"],
        "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    })  # fmt: skip


if __name__ == "__main__":
    import sys

    print(write_tiny_flux(Path(sys.argv[1])), write_tiny_zimage(Path(sys.argv[1])))
