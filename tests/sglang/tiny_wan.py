"""A tiny Wan 2.1 text-to-video checkpoint in diffusers' layout, written at test time.

sglang picks its pipeline config from the folder's name, so the checkpoint lives in a
folder named like the real one (``.../Wan2.1-T2V-1.3B-Diffusers``; Wan 2.2's two-expert
``Wan2.2-T2V-A14B-Diffusers`` with ``experts=2``). Parts: a 2-layer
``WanTransformer3DModel`` (dim 64, 2 heads), a small ``AutoencoderKLWan``, a 2-layer
UMT5 encoder, a word-level tokenizer, UniPC. Random weights with a fixed seed: the
frames mean nothing, the arithmetic is all there. Written in a few seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

WORDS = ["<pad>", "</s>", "<unk>", "a", "cat", "dog", "runs", "in", "the", "snow", "red", "ball"]
PROMPT = "a red cat runs in the snow"
TEXT_DIM = 32


def write_tiny_wan(
    root: Path,
    layers: int = 2,
    dim_head: int = 32,
    heads: int = 2,
    name: str = "Wan2.1-T2V-1.3B-Diffusers",
    experts: int = 1,
    ti2v: bool = False,
    i2v: bool = False,
) -> Path:
    """Write the checkpoint under ``root`` and return its folder. ``experts=2`` writes
    Wan 2.2 A14B's layout (``transformer_2``, the low-noise expert; name it
    ``Wan2.2-T2V-A14B-Diffusers``); ``ti2v=True`` Wan 2.2 TI2V-5B's (its 48-channel
    residual VAE with a 2x2 patch, 16x spatial; name it ``Wan2.2-TI2V-5B-Diffusers``);
    ``i2v=True`` Wan 2.1 I2V's (a CLIP vision encoder whose tokens the blocks attend to;
    name it ``Wan2.1-I2V-14B-480P-Diffusers``)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

    path = root / name
    torch.manual_seed(0)
    for folder in ("transformer", "transformer_2")[:experts]:
        _transformer(heads, dim_head, layers, 48 if ti2v else 16, i2v).save_pretrained(
            path / folder
        )
    vae = dict(base_dim=16, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
               temperal_downsample=[False, True, True])  # fmt: skip
    if ti2v:
        vae.update(
            z_dim=48, decoder_base_dim=16, is_residual=True, in_channels=12, out_channels=12,
            patch_size=2, scale_factor_spatial=16, latents_mean=[0.0] * 48,
            latents_std=[1.0] * 48,
        )  # fmt: skip
    AutoencoderKLWan(**vae).save_pretrained(path / "vae")
    UMT5EncoderModel(
        UMT5Config(
            vocab_size=len(WORDS), d_model=TEXT_DIM, d_kv=8, d_ff=64, num_layers=2,
            num_heads=4, relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1,
        )
    ).save_pretrained(path / "text_encoder")  # fmt: skip
    word_level = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=word_level, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(path / "tokenizer")
    UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    ).save_pretrained(path / "scheduler")
    index = _index()
    if i2v:
        _image_encoder(path)
        index["_class_name"] = "WanImageToVideoPipeline"
        index["image_encoder"] = ["transformers", "CLIPVisionModel"]
        index["image_processor"] = ["transformers", "CLIPImageProcessor"]
    if experts == 2:
        index["transformer_2"] = ["diffusers", "WanTransformer3DModel"]
        index["boundary_ratio"] = 0.875
    (path / "model_index.json").write_text(json.dumps(index, indent=1))
    return path


def _image_encoder(path: Path) -> None:
    from safetensors.torch import load_file, save_file
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    CLIPVisionModel(
        CLIPVisionConfig(
            hidden_size=TEXT_DIM, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, image_size=32, patch_size=16, projection_dim=TEXT_DIM,
        )
    ).save_pretrained(path / "image_encoder")  # fmt: skip
    file = path / "image_encoder" / "model.safetensors"
    weights = load_file(file)  # released checkpoints (and sglang) name them vision_model.*
    if not next(iter(weights)).startswith("vision_model."):
        weights = {"vision_model." + k: v for k, v in weights.items()}
        save_file(weights, file, metadata={"format": "pt"})
    CLIPImageProcessor(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
    ).save_pretrained(path / "image_processor")


def _index() -> dict[str, object]:
    return {
        "_class_name": "WanPipeline",
        "_diffusers_version": "0.37.0",
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLWan"],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        "scheduler": ["diffusers", "UniPCMultistepScheduler"],
    }


def _transformer(heads: int, dim_head: int, layers: int, channels: int, i2v: bool = False):
    from diffusers import WanTransformer3DModel

    image = {"image_dim": TEXT_DIM, "added_kv_proj_dim": heads * dim_head} if i2v else {}
    return WanTransformer3DModel(
        **image,
        patch_size=(1, 2, 2),
        num_attention_heads=heads,
        attention_head_dim=dim_head,
        in_channels=36 if i2v else channels,  # I2V: noise, the image's latents, a mask
        out_channels=channels,
        text_dim=TEXT_DIM,
        freq_dim=32,
        ffn_dim=128,
        num_layers=layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        rope_max_seq_len=64,
    )


def write_tiny_causal_wan(root: Path) -> Path:
    """sglang's causal Wan (``LongLive2Pipeline``: causal DMD denoising block by block with a
    KV cache, on Wan 2.2 TI2V-5B's layout; the only causal Wan 0.5.21 registers a
    checkpoint for): the TI2V checkpoint in a folder named like the released one, its
    transformer's weights under the original Wan names its loader maps from."""
    import re

    from safetensors.torch import load_file, save_file
    from sglang.multimodal_gen.configs.models.dits.longlive2 import LongLive2ArchConfig
    from sglang.multimodal_gen.configs.models.dits.wanvideo import WanVideoArchConfig

    path = write_tiny_wan(root, name="LongLive-2.0-5B-Diffusers", ti2v=True)
    for file, key, value in (
        (path / "model_index.json", "_class_name", "LongLive2Pipeline"),
        (path / "transformer" / "config.json", "_class_name", "LongLive2Transformer3DModel"),
    ):
        data = json.loads(file.read_text())
        data[key] = value
        file.write_text(json.dumps(data, indent=1))

    def rename(name: str, mapping: dict) -> str:
        for pattern, to in mapping.items():
            if re.match(pattern, name):
                return re.sub(pattern, to if isinstance(to, str) else to[0], name)
        return name

    to_sglang = WanVideoArchConfig().param_names_mapping  # diffusers' names -> sglang's
    to_original = LongLive2ArchConfig().reverse_param_names_mapping  # sglang's -> original
    for file in (path / "transformer").glob("*.safetensors"):
        weights = load_file(file)
        weights = {rename(rename(k, to_sglang), to_original): v for k, v in weights.items()}
        save_file(weights, file, metadata={"format": "pt"})
    return path


if __name__ == "__main__":
    import sys

    print(write_tiny_wan(Path(sys.argv[1])))
