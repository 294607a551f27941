"""Tiny diffusers pipelines built in memory from keyword arguments: random weights, no
download, seconds on a CPU. The quick mode of ``ditops bench`` runs one, and the docs'
examples run on them in the tests (``tests/test_doc_blocks.py``) where a page names a
checkpoint.

The frames they make mean nothing; the arithmetic of every part is the real one
(diffusers' transformer, VAE and scheduler, transformers' UMT5 text encoder with a
word-level tokenizer). Needs ``diffusers`` and ``transformers``: ``pip install
'ditops[pipelines]'``.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

#: The tokenizer's words; any other word of a prompt is ``<unk>``.
WORDS = ("<pad>", "</s>", "<unk>", "a", "cat", "dog", "surfing", "runs", "in", "the", "snow")
TEXT_DIM = 32

#: A call small enough for a tiny pipeline (the pipeline's defaults are 480 x 832 x 81).
TINY_CALL: dict[str, Any] = {"height": 64, "width": 64, "num_frames": 9}


class MissingPackage(ImportError):
    """A package the tiny pipelines need is not installed; the message says what to run."""


def require(*modules: str) -> None:
    """Raise :class:`MissingPackage` naming the extra to install when one is absent."""
    absent = [m for m in modules if importlib.util.find_spec(m) is None]
    if absent:
        raise MissingPackage(
            f"{' and '.join(absent)} not installed: pip install 'ditops[pipelines]' "
            "(diffusers' pipelines need transformers for their text encoders)"
        )


def tiny_wan_transformer(layers: int = 2, heads: int = 2, head_dim: int = 32) -> Any:
    """A ``WanTransformer3DModel`` of Wan2.1's layout, ``heads x head_dim`` wide."""
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=heads,
        attention_head_dim=head_dim,
        in_channels=16,
        out_channels=16,
        text_dim=TEXT_DIM,
        freq_dim=32,
        ffn_dim=4 * heads * head_dim,
        num_layers=layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        rope_max_seq_len=64,
    ).eval()


def _text_parts() -> tuple[Any, Any]:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

    encoder = UMT5EncoderModel(
        UMT5Config(
            vocab_size=len(WORDS),
            d_model=TEXT_DIM,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            pad_token_id=0,
            eos_token_id=1,
        )
    ).eval()
    words = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )
    return encoder, tokenizer


def tiny_wan_pipeline(
    dtype: torch.dtype = torch.float32, layers: int = 2, heads: int = 2, head_dim: int = 32
) -> Any:
    """A ``WanPipeline`` of tiny parts (seed 0): a ``layers``-layer transformer, a small
    ``AutoencoderKLWan``, a 2-layer UMT5 encoder, UniPC; the transformer in ``dtype``."""
    require("diffusers", "transformers")
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline

    from ditops.bench.wan_model import cast_like_from_pretrained

    torch.manual_seed(0)
    transformer = cast_like_from_pretrained(tiny_wan_transformer(layers, heads, head_dim), dtype)
    vae = AutoencoderKLWan(
        base_dim=16,
        z_dim=16,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
    ).eval()
    encoder, tokenizer = _text_parts()
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    )
    pipe = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=encoder.to(dtype),
        vae=vae,
        scheduler=scheduler,
        transformer=transformer,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe
