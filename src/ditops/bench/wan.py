"""Benchmark suite ``wan``, the default of ``ditops bench``: a small Wan model end to end.

A ``WanTransformer3DModel`` built from keyword arguments (random weights, no download;
or ``--model PATH``: a local diffusers checkpoint) runs a short denoising loop on a
video shaped like Wan's: 21 latent frames (81 video frames) of 16 x 24 tokens after 2x2
patching (8064 tokens; ``--size full``: Wan 480p, 21 frames of 30 x 52 = 32760 tokens).
Every variant sees the same inputs at a step: the latents follow the unpatched model's
trajectory (an Euler step with its output), so inputs change from step to step as in a
pipeline, and each step's output is compared at equal inputs. Variants:

* ``unpatched``: diffusers as it is;
* ``norms exact``: ``ditops.patch(model, precision="exact")`` (fused norm/modulation chain);
* ``sparse 0.5`` / ``0.75`` / ``0.9``: norms plus block-sparse self-attention after
  ``skip_first_steps`` dense steps, at that sparsity (forced blocks included);
* ``sparse 0.75 /2``: the same at 0.75, masks estimated every ``REUSE_EVERY`` sparse
  steps and reused in between;
* ``sparse 0.75 perm``: the same at 0.75 in the permuted mode
  (``BlockSparseConfig(permute=True)``: tokens clustered per head, clusters warm-started
  from step to step), against ``sparse 0.75`` at the same density.

Per variant and step: the time of one forward, the speedup over the unpatched model at
that step, the time inside the estimate and inside the attention kernels of the
self-attention (dense SDPA, or the sparse op), the realised block density of the masks,
and the drift of the output from the unpatched one (max abs, cosine, PSNR); the reuse
variant's drift from the per-step estimate too. Dense steps of the sparse variants run
the same code as ``norms exact`` (bitwise) and are not run again: they take its row.
Also a JSON file and a PNG plot (time per step, where a forward's time goes).

This module holds the loop (:func:`run`); the model and its inputs are in
:mod:`ditops.bench.wan_model`, the timing probes in :mod:`ditops.bench.wan_probes`, the
summary, report and plot in :mod:`ditops.bench.wan_report`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ditops.bench.wan_model import build_model
from ditops.bench.wan_probes import AttentionProbe, SectionTimer, timed_step
from ditops.bench.wan_report import TARGET, plot, summary

#: latent [B, C, F, H, W]: 21 latent frames (81 video frames), patched 2x2: 21 x 16 x 24 =
#: 8064 video tokens ("small", the first frame 3 blocks of 128); "full": Wan 480p, 21 x 30
#: x 52 = 32760 tokens (the first frame 13 blocks), for GPUs and patient CPU users.
LATENTS = {"small": (1, 16, 21, 32, 48), "full": (1, 16, 21, 60, 104)}
SIZE_NAMES = {"small": "Wan-like, 21 latent frames", "full": "Wan 480p, 21 latent frames"}
STEPS = {"small": 4, "full": 4}
SKIP_FIRST_STEPS = 1
#: Calls timed per step and variant (the fastest is kept); ``FULL_REPEATS`` at "full".
REPEATS = 2
FULL_REPEATS = 1
#: The reuse variant estimates its masks every this many sparse steps.
REUSE_EVERY = 2
#: Sparsities of the sparse variants; the reuse variant runs at ``REUSE_SPARSITY``.
SPARSITIES = (0.5, 0.75, 0.9)
REUSE_SPARSITY = 0.75
TEXT_TOKENS = 512


@dataclass
class StepResult:
    variant: str
    step: int
    seconds: float
    dense: bool
    max_abs: float
    cosine: float
    psnr: float
    sections: dict[str, float]
    #: What the self-attentions did: see :class:`~ditops.bench.wan_probes.AttentionProbe`.
    attention: dict[str, Any]
    #: "dense", "estimate" (masks estimated), "reuse" (masks reused), or "dense (norms
    #: exact)" where the row is that variant's.
    kind: str = "dense"
    #: The reuse variant's drift from the per-step estimate at the same sparsity.
    vs_per_step: tuple[float, float, float] | None = None


def _drift(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float]:
    from ditops.bench.accuracy import drift

    return drift(out, ref)


def _sparse(sparsity: float, estimate_every: int = 1, permute: bool = False) -> Any:
    from ditops.attention.schedule import BlockSparseConfig

    return BlockSparseConfig(
        sparsity=sparsity,
        skip_first_steps=SKIP_FIRST_STEPS,
        estimate_every=estimate_every,
        permute=permute,
    )


def _variants() -> list[tuple[str, dict[str, Any] | None]]:
    sparse = [(f"sparse {s}", {"precision": "exact", "attention": _sparse(s)}) for s in SPARSITIES]
    reuse = (
        f"sparse {REUSE_SPARSITY} /{REUSE_EVERY}",
        {"precision": "exact", "attention": _sparse(REUSE_SPARSITY, REUSE_EVERY)},
    )
    permuted = (
        f"sparse {REUSE_SPARSITY} perm",
        {"precision": "exact", "attention": _sparse(REUSE_SPARSITY, permute=True)},
    )
    return [("unpatched", None), ("norms exact", {"precision": "exact"}), *sparse, reuse, permuted]


def _keeps_state(options: dict[str, Any] | None) -> bool:
    """Whether a variant's layers carry state across steps (reused masks, warm-started
    clusters): it then gets models of its own rather than a model patched per call."""
    cfg = _config_of(options)
    return cfg is not None and (cfg.estimate_every > 1 or cfg.permute)


def _config_of(options: dict[str, Any] | None) -> Any:
    return None if options is None else options.get("attention")


def _per_step_twin(name: str, variants: list[tuple[str, dict[str, Any] | None]]) -> str | None:
    """The variant estimating at every step at the same sparsity as reuse variant ``name``."""
    cfg = _config_of(dict(variants)[name])
    for other, options in variants:
        twin = _config_of(options)
        if twin is not None and twin.estimate_every == 1 and twin.sparsity == cfg.sparsity:
            return other
    return None


#: A forward slower than this (the unpatched warm-up call, seconds) makes the small size
#: time each step once instead of ``REPEATS`` times, to stay within minutes.
SLOW_FORWARD_S = 8.0


def run(
    device: torch.device,
    size: str,
    *,
    model_path: str | None = None,
    progress: bool = True,
    plot_path: str | None = None,
    dtype: torch.dtype = torch.bfloat16,
    only: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Run the loop for every variant (``only``: these besides ``unpatched`` and ``norms
    exact``, in the suite's order); returns rows and a summary (see module docstring)."""
    import copy
    import dataclasses

    from ditops.bench.harness import Progress, machine_info
    from ditops.integrations import patch, unpatch

    model = build_model(model_path, device, dtype)
    cfg = model.config
    latent = list(LATENTS[size])
    latent[1] = cfg.in_channels
    gen = torch.Generator(device="cpu").manual_seed(1)
    latents = [torch.randn(latent, generator=gen).to(device, dtype)]
    text = torch.randn(1, TEXT_TOKENS, cfg.text_dim, generator=gen).to(device, dtype)
    n_steps = STEPS[size]
    repeats = REPEATS if size == "small" else FULL_REPEATS
    timesteps = torch.linspace(999, 0, n_steps).round().to(device)
    variants = _variants()
    if only is not None:
        unknown = set(only) - {n for n, _ in variants}
        if unknown:
            raise ValueError(f"wan bench: no variants {sorted(unknown)}; see _variants()")
        variants = variants[:2] + [(n, o) for n, o in variants[2:] if n in only]
    own: dict[str, list[Any]] = {}
    bar = Progress(len(variants) * n_steps, "wan", progress)
    outputs: dict[tuple[str, int], torch.Tensor] = {}
    results: list[StepResult] = []
    warmups: dict[str, float] = {}

    def use(name: str, options: dict[str, Any] | None, repeat: int) -> Any:
        if name in own:
            return own[name][repeat]
        unpatch(model)
        if options is not None:
            patch(model, **options)
        return model

    def call(
        target: Any, step: int, x: torch.Tensor
    ) -> tuple[torch.Tensor, float, dict[str, float], Any]:
        with SectionTimer(target, device) as sections, AttentionProbe(target, device) as att:
            out, seconds = timed_step(target, x, timesteps, text, step, n_steps, device)
        return out, seconds, sections.seconds, att

    try:
        # One untimed call per kind of work, at the last (a sparse) step: compiles
        # (FlexAttention) and first-touch allocations stay out of the step times.
        for name, options in variants[:1] + variants[2:3]:
            warmups[name] = call(use(name, options, 0), n_steps - 1, latents[0])[1]
        if repeats > 1 and warmups[variants[0][0]] > SLOW_FORWARD_S:
            repeats = 1  # a slow machine: minutes, not an hour (the report says so)
        # A variant that keeps masks across steps gets models of its own, one per repeat,
        # each living one pipeline run; the others share the model, patched for each call.
        for name, options in variants:
            if _keeps_state(options):
                own[name] = []
                for _ in range(repeats):
                    twin = copy.deepcopy(model)
                    unpatch(twin)
                    patch(twin, **options)
                    own[name].append(twin)
        for i in range(n_steps):
            # Variants take turns at every step, so a slow spell of a shared machine
            # lands on all of them rather than on one.
            for name, options in variants:
                bar.step(f"{name} step {i}")
                sparse_cfg = _config_of(options)
                dense = sparse_cfg is None or i < SKIP_FIRST_STEPS
                if sparse_cfg is not None and dense:
                    # The same code as norms exact (bitwise): its row stands for this one.
                    base = next(r for r in results if r.variant == "norms exact" and r.step == i)
                    results.append(
                        dataclasses.replace(base, variant=name, kind="dense (norms exact)")
                    )
                    outputs[(name, i)] = outputs[("norms exact", i)]
                    continue
                # The faster of the repeats: a single call can catch a noisy moment.
                timings = [call(use(name, options, r), i, latents[i]) for r in range(repeats)]
                out, seconds, section_seconds, att = min(timings, key=lambda t: t[1])
                outputs[(name, i)] = out
                if name == "unpatched" and i + 1 < n_steps:
                    # The next step's input: an Euler step along the unpatched trajectory.
                    dt = float(timesteps[i + 1] - timesteps[i]) / 1000
                    latents.append((latents[i].float() + dt * out.float()).to(dtype))
                kind = "dense" if dense else ("estimate" if att.estimates else "reuse")
                drift = _drift(out, outputs[("unpatched", i)])
                results.append(
                    StepResult(
                        name, i, seconds, dense, *drift, section_seconds, att.as_dict(), kind
                    )
                )
    finally:
        bar.close()
        unpatch(model)
    for name in own:
        twin_name = _per_step_twin(name, variants)
        for r in results:
            if r.variant == name and not r.dense and twin_name is not None:
                r.vs_per_step = _drift(outputs[(name, r.step)], outputs[(twin_name, r.step)])
    order = [v for v, _ in variants]
    results.sort(key=lambda r: (order.index(r.variant), r.step))
    base = {r.step: r for r in results if r.variant == "unpatched"}
    rows = []
    for r in results:
        row = {**r.__dict__, "speedup": base[r.step].seconds / r.seconds}
        cfg_ = _config_of(dict(variants)[r.variant])
        row["requested_density"] = None if cfg_ is None else 1 - cfg_.sparsity
        row["dense_attention_s"] = base[r.step].attention["attention_s"]
        rows.append(row)
    summary_ = summary(rows, n_steps)
    if plot_path:
        plot(rows, summary_, plot_path, SKIP_FIRST_STEPS)
    mask_cfg = _sparse(REUSE_SPARSITY)  # every sparse variant's estimate method
    return {
        "machine": machine_info(device),
        "dtype": str(dtype).replace("torch.", ""),
        "size": size,
        "size_name": SIZE_NAMES.get(size, size),
        "config": {
            k: (list(v) if isinstance(v, tuple) else v)
            for k, v in dict(cfg).items()
            if not k.startswith("_")
        },
        "latent_shape": latent,
        "video_tokens": latent[2]
        * (latent[3] // cfg.patch_size[1])
        * (latent[4] // cfg.patch_size[2]),
        "steps": n_steps,
        "repeats": repeats,
        "skip_first_steps": SKIP_FIRST_STEPS,
        "reuse_every": REUSE_EVERY,
        "mask_method": {"method": mask_cfg.method, "samples": mask_cfg.samples},
        "warmup_seconds": warmups,
        "rows": rows,
        "summary": summary_,
        "target": {"sparsity": TARGET[0], "speedup_per_sparse_step": TARGET[1]},
    }
