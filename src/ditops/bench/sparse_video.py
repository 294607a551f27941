"""The sparse-attention video benches' :class:`~ditops.bench.model_bench.VariantKind`
(``hunyuan_video``, ``ltx_video``, ``cogvideox``): their variants (unpatched, exact,
block-sparse at each sparsity, the permuted mode), the probe of the attention modules
(seconds, densities of the estimated masks), the summary per variant and its table."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

from ditops.bench.model_bench import VariantKind
from ditops.bench.model_runs import SparseAttentionProbe, sparse_variants, timing_summary

SPARSITIES = (0.5, 0.75)
PERMUTED_SPARSITY = 0.75


def default_dtype(device: torch.device) -> torch.dtype:
    from ditops.platform import cpu_half_matmuls_slow

    return torch.float32 if device.type == "cpu" and cpu_half_matmuls_slow() else torch.bfloat16


def padded_text_mask(text_tokens: int) -> torch.Tensor:
    """A ``[1, text_tokens]`` attention mask with its last quarter padded (zeros)."""
    mask = torch.ones(1, text_tokens, dtype=torch.int64)
    mask[:, text_tokens - text_tokens // 4 :] = 0
    return mask


def video_facts(
    config: dict[str, Any], latent: tuple[int, int, int], text_tokens: int
) -> dict[str, int]:
    """What a result says of a latent video (frames, height, width) patched by the config's
    ``patch_size_t`` and ``patch_size``, and of text whose last quarter is padded."""
    frames, h, w = latent
    p, pt = config["patch_size"], config.get("patch_size_t") or 1
    return {
        "video_tokens": frames // pt * (h // p) * (w // p),
        "text_tokens": text_tokens,
        "padded_text_tokens": text_tokens // 4,
    }


def video_inputs(make_inputs: Callable[..., dict[str, Any]]) -> Callable[..., Any]:
    """A :class:`~ditops.bench.model_bench.ModelBench`'s ``inputs`` from a ``make_inputs(
    config, latent, text_tokens, device, dtype)``: its forward kwargs and
    :func:`video_facts`."""

    def inputs(
        config: dict[str, Any], device: Any, dtype: Any, latent: Any, text_tokens: int
    ) -> Any:
        x = make_inputs(config, latent, text_tokens, device, dtype)
        return x, video_facts(config, latent, text_tokens)

    return inputs


def summarise(
    variants: list[tuple[str, dict[str, Any]]],
    outputs: dict[str, torch.Tensor],
    times: dict[str, list[float]],
    probes: dict[str, list[Any]],
) -> list[dict[str, Any]]:
    """Per variant of :func:`~ditops.bench.model_runs.interleaved_forwards`' run (its
    :class:`~ditops.bench.model_runs.SparseAttentionProbe` probes): timings, ratios to
    ``unpatched``, densities asked and run, drift."""
    from ditops.bench.accuracy import drift

    attn = {name: [p.seconds for p in ps] for name, ps in probes.items()}
    densities = {name: [d for p in ps for d in p.densities] for name, ps in probes.items()}
    peak = float(outputs["unpatched"].double().abs().max()) or 1.0
    summary = []
    for name, options in variants:
        max_abs, cosine, psnr = drift(outputs[name], outputs["unpatched"])
        cfg = options.get("attention")
        summary.append(
            {
                **timing_summary(name, times, attn),
                "attention_speedup": statistics.median(
                    u / t for u, t in zip(attn["unpatched"], attn[name])
                ),
                "requested_density": None if cfg is None else 1 - cfg.sparsity,
                "realised_density": (
                    statistics.fmean(densities[name]) if densities[name] else None
                ),
                "max_rel": max_abs / peak,
                "cosine": cosine,
                "psnr_db": psnr,
                "bitwise_equal": bool(torch.equal(outputs[name], outputs["unpatched"])),
            }
        )
    return summary


#: Unpatched, exact, block-sparse at each of :data:`SPARSITIES` and the permuted mode at
#: :data:`PERMUTED_SPARSITY`; bf16 (fp32 on a CPU whose bf16 matmuls are a slow fallback).
SPARSE = VariantKind(
    variants=lambda block_size: sparse_variants(block_size, SPARSITIES, PERMUTED_SPARSITY),
    probe=SparseAttentionProbe,
    summarise=summarise,
    columns=(
        ("variant", "variant", "<12"),
        ("s/forward", "median_seconds", ">9.3f"),
        ("attn s", "median_attention_seconds", ">7.3f"),
        ("x fwd", "speedup", ">6.2f"),
        ("x attn", "attention_speedup", ">6.2f"),
        ("asked", "requested_density", ">5.2f"),
        ("run", "realised_density", ">5.3f"),
        ("bitwise", "bitwise_equal", ">7"),
        ("max rel", "max_rel", ">8.1e"),
        ("cosine", "cosine", ">9.6f"),
        ("PSNR dB", "psnr_db", ">7.1f"),
    ),
    note="(medians over rounds; x fwd / x attn: median per-round ratios of the whole forward "
    "and of the attention modules to unpatched; asked/run: block density of the video "
    "queries' maps, forced blocks included; drift against the unpatched output)",
    dtype=default_dtype,
    block_size=True,
)
