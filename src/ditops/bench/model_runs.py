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


def sparse_variants(
    block_size: int, sparsities: Iterable[float], permuted: float | None = None
) -> list[tuple[str, dict[str, Any]]]:
    """A sparse-attention model bench's variants: unpatched, exact, one block-sparse
    variant per sparsity and, with ``permuted``, the permuted mode at that sparsity (no
    step index here: each call clusters from a cold start, the order choice included,
    the permuted mode's dearest call)."""
    from ditops.attention.schedule import BlockSparseConfig

    out: list[tuple[str, dict[str, Any]]] = [("unpatched", {}), ("exact", {"attention": None})]
    stride = min(8, block_size)
    for s in sparsities:
        cfg = BlockSparseConfig(sparsity=s, block_size=block_size, stride=stride)
        out.append((f"sparse {s}", {"attention": cfg}))
    if permuted is not None:
        perm = BlockSparseConfig(
            sparsity=permuted, block_size=block_size, stride=stride, permute=True
        )
        out.append((f"sparse {permuted} perm", {"attention": perm}))
    return out


class SparseAttentionProbe(ModuleTimer):
    """Seconds inside the attention ``modules`` and the densities of the estimated masks."""

    def __init__(self, device: torch.device, modules: list[Any]) -> None:
        from ditops.ops.estimate_block_mask import estimate_block_mask

        self.densities: list[float] = []

        def estimated(_m: Any, _a: Any, out: Any) -> None:
            mask, counts = out
            self.densities.append(float(counts.float().mean()) / int(mask.shape[-1]))

        super().__init__(modules, device)
        self._handles.append(estimate_block_mask.op.register_forward_hook(estimated))


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
