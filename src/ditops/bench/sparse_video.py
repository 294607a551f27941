"""The runner the sparse-attention video benches (``hunyuan_video``, ``ltx_video``,
``cogvideox``) are declared on: their variants (unpatched, exact, block-sparse at each
sparsity, the permuted mode), one model's forwards timed interleaved with the attention
modules probed, the summary per variant and its table."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

from ditops.bench.model_runs import (
    SparseAttentionProbe,
    interleaved_forwards,
    timing_summary,
)

SPARSITIES = (0.5, 0.75)
PERMUTED_SPARSITY = 0.75


def default_dtype(device: torch.device) -> torch.dtype:
    from ditops.platform import cpu_half_matmuls_slow

    return torch.float32 if device.type == "cpu" and cpu_half_matmuls_slow() else torch.bfloat16


def time_variants(
    model: Any,
    x: dict[str, Any],
    device: torch.device,
    variants: list[tuple[str, dict[str, Any]]],
    rounds: int,
    attentions: Callable[[Any], list[Any]],
    desc: str,
    progress: bool,
) -> tuple[dict[str, list[float]], dict[str, list[float]], list[dict[str, Any]]]:
    """``model``'s forward on ``x`` under each variant (``patch(model, precision="exact",
    **options)``; unpatched for ``{}``), interleaved for ``rounds`` rounds
    (:func:`~ditops.bench.model_runs.interleaved_forwards`) with ``attentions(model)``
    probed: the seconds per forward and inside the attentions per variant, and
    :func:`summarise`'s rows."""
    from ditops.integrations import patch, unpatch

    def use(options: dict[str, Any]) -> None:
        unpatch(model)
        if options:
            patch(model, precision="exact", **options)

    outputs, times, probes = interleaved_forwards(
        model,
        x,
        device,
        variants,
        use,
        rounds,
        lambda m: SparseAttentionProbe(device, attentions(m)),
        desc=desc,
        progress=progress,
        reset=lambda: unpatch(model),
    )
    attn = {name: [p.seconds for p in ps] for name, ps in probes.items()}
    return times, attn, summarise(variants, outputs, times, probes)


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


def _f(v: float | None, spec: str) -> str:
    return format(v, spec) if v is not None else "-".rjust(int(spec.split(".")[0]))


def print_rows(summary: list[dict[str, Any]], out: Any) -> None:
    """The table of :func:`summarise`'s rows, and what its columns are."""
    print(
        f"{'variant':<12} {'s/forward':>9} {'attn s':>7} {'x fwd':>6} {'x attn':>6} "
        f"{'asked':>5} {'run':>5} {'bitwise':>7} {'max rel':>8} {'cosine':>9} {'PSNR dB':>7}",
        file=out,
    )
    for s in summary:
        print(
            f"{s['variant']:<12} {s['median_seconds']:>9.3f} "
            f"{s['median_attention_seconds']:>7.3f} {s['speedup']:>6.2f} "
            f"{s['attention_speedup']:>6.2f} {_f(s['requested_density'], '5.2f')} "
            f"{_f(s['realised_density'], '5.3f')} {str(s['bitwise_equal']):>7} "
            f"{s['max_rel']:>8.1e} {s['cosine']:>9.6f} {s['psnr_db']:>7.1f}",
            file=out,
        )
    print(
        "(medians over rounds; x fwd / x attn: median per-round ratios of the whole forward "
        "and of the attention modules to unpatched; asked/run: block density of the video "
        "queries' maps, forced blocks included; drift against the unpatched output)",
        file=out,
    )
