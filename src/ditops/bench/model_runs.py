"""What the model benches (``wan``, ``flux``, ``hunyuan_video``, the video-scaling probe)
share: building a seeded model at a size, timing whole forwards interleaved across
variants, timing sub-modules with hooks, and summarising the times."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ditops.bench.harness import Progress, sync


def timed_forward(
    model: Any, x: dict[str, torch.Tensor], device: torch.device
) -> tuple[Any, float]:
    """One ``model(**x)`` forward (inference mode) and its seconds, the device synchronised."""
    with torch.inference_mode():
        sync(device)
        t0 = time.perf_counter()
        out = model(**x, return_dict=False)[0]
        sync(device)
        return out, time.perf_counter() - t0


def size_config(
    suite: str,
    sizes: dict[str, dict[str, Any]],
    size: str,
    base: dict[str, Any],
    overrides: dict[str, Any],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A model bench's ``size`` entry of ``sizes`` (refused, naming ``suite``, if there is
    none) and its model config: ``base``, the size's ``"config"``, then ``overrides``."""
    if size not in sizes:
        raise ValueError(f"{suite} bench: size must be one of {sorted(sizes)}, got {size!r}")
    spec = sizes[size]
    return spec, {**base, **spec["config"], **overrides}


def build_seeded(cls: Any, device: torch.device, dtype: torch.dtype, config: dict[str, Any]) -> Any:
    """A model of class ``cls`` built from ``config`` on ``device`` with seed 0 (random
    weights, no download), cast to ``dtype``, in eval mode."""
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(**config)
    return model.to(dtype).eval()


class ModuleTimer:
    """Seconds spent inside ``modules`` (a forward pre- and post-hook on each, the device
    synchronised at both) until :meth:`remove`."""

    def __init__(self, modules: Iterable[Any], device: torch.device) -> None:
        self.seconds = 0.0
        start = [0.0]

        def pre(*_: Any) -> None:
            sync(device)
            start[0] = time.perf_counter()

        def post(*_: Any) -> None:
            sync(device)
            self.seconds += time.perf_counter() - start[0]

        self._handles = [
            h
            for m in modules
            for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))
        ]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def interleaved_forwards(
    model: Any,
    x: dict[str, torch.Tensor],
    device: torch.device,
    variants: Sequence[tuple[str, Any]],
    use: Callable[[Any], None],
    rounds: int,
    probe: Callable[[Any], Any],
    *,
    desc: str,
    progress: bool = True,
    reset: Callable[[], None] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, list[float]], dict[str, list[Any]]]:
    """``model(**x)`` under each of ``variants`` (``(name, option)``; ``use(option)`` sets
    the model up) in turns: one untimed call each (first-touch allocations, plans), whose
    output is kept, then ``rounds`` rounds of timed calls, each with ``probe(model)``
    attached (an object with ``remove()``, removed after the call), so that a slow spell
    of a shared machine lands on every variant alike. A progress bar (``desc``) on stderr;
    ``reset()`` runs at the end, whatever happens. Returns the outputs, the seconds and the
    probes, by variant name."""
    outputs: dict[str, torch.Tensor] = {}
    times: dict[str, list[float]] = {name: [] for name, _ in variants}
    probes: dict[str, list[Any]] = {name: [] for name, _ in variants}
    bar = Progress(len(variants) * (rounds + 1), desc, progress)
    try:
        for name, option in variants:
            bar.step(f"{name} warm-up")
            use(option)
            outputs[name] = timed_forward(model, x, device)[0]
        for r in range(rounds):
            for name, option in variants:
                bar.step(f"{name} round {r}")
                use(option)
                p = probe(model)
                try:
                    _, seconds = timed_forward(model, x, device)
                finally:
                    p.remove()
                times[name].append(seconds)
                probes[name].append(p)
    finally:
        bar.close()
        if reset is not None:
            reset()
    return outputs, times, probes


def timing_summary(
    name: str,
    times: dict[str, list[float]],
    attention: dict[str, list[float]],
    baseline: str = "unpatched",
) -> dict[str, Any]:
    """Variant ``name``'s medians of the seconds per forward and inside the attention, and
    the median of its per-round ratios to ``baseline`` (the speedup)."""
    return {
        "variant": name,
        "median_seconds": statistics.median(times[name]),
        "median_attention_seconds": statistics.median(attention[name]),
        "speedup": statistics.median(u / t for u, t in zip(times[baseline], times[name])),
    }


def variant_summaries(
    variants: Sequence[tuple[str, dict[str, Any]]],
    outputs: dict[str, torch.Tensor],
    times: dict[str, list[float]],
    attention: dict[str, list[float]],
    densities: dict[str, list[float]],
) -> list[dict[str, Any]]:
    """Per variant (``(name, patch options)``, ``"unpatched"`` the baseline): the timing
    summary, the attention's speedup, the block density asked (``options["attention"]``)
    and realised (the mean of ``densities``), and the drift of its output from the
    unpatched one (max abs relative to its peak, cosine, PSNR; bitwise equal or not)."""
    from ditops.bench.harness import drift

    peak = float(outputs["unpatched"].double().abs().max()) or 1.0
    summary = []
    for name, options in variants:
        max_abs, cosine, psnr = drift(outputs[name], outputs["unpatched"])
        cfg = options.get("attention")
        summary.append({
            **timing_summary(name, times, attention),
            "attention_speedup": statistics.median(
                u / t for u, t in zip(attention["unpatched"], attention[name])
            ),
            "requested_density": None if cfg is None else 1 - cfg.sparsity,
            "realised_density": statistics.fmean(densities[name]) if densities[name] else None,
            "max_rel": max_abs / peak,
            "cosine": cosine,
            "psnr_db": psnr,
            "bitwise_equal": bool(torch.equal(outputs[name], outputs["unpatched"])),
        })  # fmt: skip
    return summary


def print_variant_rows(summary: list[dict[str, Any]], out: Any) -> None:
    """The table of :func:`variant_summaries`, one row per variant, and what it means."""

    def f(v: float | None, spec: str) -> str:
        return format(v, spec) if v is not None else "-".rjust(int(spec.split(".")[0]))

    print(
        f"{'variant':<12} {'s/forward':>9} {'attn s':>7} {'x fwd':>6} {'x attn':>6} "
        f"{'asked':>5} {'run':>5} {'bitwise':>7} {'max rel':>8} {'cosine':>9} {'PSNR dB':>7}",
        file=out,
    )
    for s in summary:
        print(
            f"{s['variant']:<12} {s['median_seconds']:>9.3f} "
            f"{s['median_attention_seconds']:>7.3f} {s['speedup']:>6.2f} "
            f"{s['attention_speedup']:>6.2f} {f(s['requested_density'], '5.2f')} "
            f"{f(s['realised_density'], '5.3f')} {str(s['bitwise_equal']):>7} "
            f"{s['max_rel']:>8.1e} {s['cosine']:>9.6f} {s['psnr_db']:>7.1f}",
            file=out,
        )
    print(
        "(medians over rounds; x fwd / x attn: median per-round ratios of the whole forward "
        "and of the attention modules to unpatched; asked/run: block density of the video "
        "queries' maps, forced blocks included; drift against the unpatched output)",
        file=out,
    )
