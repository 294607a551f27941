"""The small Wan model of the ``wan`` suite: built from :data:`DEFAULT_CONFIG` (random
weights, cast as ``from_pretrained`` would), or loaded from ``--model PATH`` (a local
diffusers checkpoint); one forward's inputs; the dtype the suite runs in on this device.

Also used by the ``parallel`` and ``video_scaling`` suites and by the integration tests.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch

from ditops.platform import cpu_half_matmuls_slow

#: The default model: Wan's 1.3B width (12 heads of 128, ffn 8960), fewer layers.
DEFAULT_CONFIG: dict[str, Any] = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 12,
    "attention_head_dim": 128,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 4096,
    "freq_dim": 256,
    "ffn_dim": 8960,
    "num_layers": 2,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "rope_max_seq_len": 1024,
}


def cast_like_from_pretrained(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Cast ``model`` to ``dtype`` the way ``from_pretrained(torch_dtype=dtype)`` loads it.

    Floating parameters and persistent buffers go to ``dtype``, except those whose dotted
    name holds one of the model's ``_keep_in_fp32_modules`` (Wan: norms, the time
    embedder, the modulation tables), which stay fp32. ``model.to(dtype)`` would cast
    those too (diffusers warns that results then differ from the checkpoint's).
    """
    keep = list(getattr(model, "_keep_in_fp32_modules", None) or [])
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            if t.is_floating_point():
                fp32 = any(k in name.split(".") for k in keep)
                t.data = t.data.to(torch.float32 if fp32 else dtype)
    return model


class ModelLoadError(RuntimeError):
    """``--model PATH`` could not be loaded; the message says why in one line."""


def build_model(
    path: str | None, device: torch.device, dtype: torch.dtype, **overrides: Any
) -> Any:
    """The model at ``path``, or (None) :data:`DEFAULT_CONFIG` with ``overrides`` applied,
    random weights cast as :func:`cast_like_from_pretrained` does."""
    from diffusers import WanTransformer3DModel

    if path is None:
        torch.manual_seed(0)
        with torch.device(device):
            model = WanTransformer3DModel(**{**DEFAULT_CONFIG, **overrides})
        return cast_like_from_pretrained(model, dtype).eval()
    if overrides:
        raise ValueError("wan.build_model: config overrides apply to a built model, not to --model")
    if not os.path.isdir(path):
        raise ModelLoadError(f"--model {path!r} is not a directory holding a diffusers checkpoint")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelLoadError(
            f"--model {path!r} has no config.json: not a diffusers model folder (for a "
            "pipeline folder, pass its transformer/ subfolder)"
        )
    if importlib.util.find_spec("accelerate") is None:
        # diffusers loads Wan's fp32 modules with low_cpu_mem_usage, which needs accelerate
        # (without it: a ValueError about low_cpu_mem_usage after a long warning).
        raise ModelLoadError(
            f"loading --model {path!r} needs accelerate: pip install accelerate "
            "(or pip install 'ditops[bench]')"
        )
    try:
        model = WanTransformer3DModel.from_pretrained(
            path, torch_dtype=dtype, local_files_only=True
        )
    except (OSError, ValueError, KeyError, ImportError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"--model {path!r} could not be loaded: {first}") from exc
    return model.to(device).eval()


def make_inputs(config: dict[str, Any], latent: tuple[int, ...], *args: Any) -> dict[str, Any]:
    """One forward's keyword arguments: latents (``latent``: frames, height, width), text
    and timestep; ``args``: the text tokens, the device and the dtype (the order
    :func:`ditops.bench.hunyuan_video.make_inputs` takes them in)."""
    text_tokens, device, dtype = args
    gen = torch.Generator(device="cpu").manual_seed(1)
    latents = torch.randn(1, config["in_channels"], *latent, generator=gen)
    text = torch.randn(1, text_tokens, config["text_dim"], generator=gen)
    return {
        "hidden_states": latents.to(device, dtype),
        "timestep": torch.tensor([900], device=device),
        "encoder_hidden_states": text.to(device, dtype),
    }


def cpu_warning(device: torch.device, dtype: torch.dtype) -> str | None:
    """A line to show when bf16/fp16 matmuls would run on this CPU's slow fallback."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return None
    capability = cpu_half_matmuls_slow()
    if capability is None:
        return None
    return (
        f"this CPU runs torch at capability {capability} (no AVX-512): {dtype} matmuls take "
        "a fallback tens of times slower than float32, so the linear layers dominate and the "
        "bench takes hours; --dtype float32 measures the same work in float32"
    )


def default_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 (what Wan runs in), or float32 on a CPU whose bf16 matmuls are a slow
    fallback (:func:`cpu_warning`): the same work, in far less time (one forward in each
    dtype: benchmarks/cpu/probes/wan_forward_dtype.txt)."""
    return torch.float32 if cpu_warning(device, torch.bfloat16) else torch.bfloat16
