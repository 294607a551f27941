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
  steps and reused in between.

Per variant and step: the time of one forward, the speedup over the unpatched model at
that step, the time inside the estimate and inside the attention kernels of the
self-attention (dense SDPA, or the sparse op), the realised block density of the masks,
and the drift of the output from the unpatched one (max abs, cosine, PSNR); the reuse
variant's drift from the per-step estimate too. Dense steps of the sparse variants run
the same code as ``norms exact`` (bitwise) and are not run again: they take its row.
Also a JSON file and a PNG plot (time per step, where a forward's time goes).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from dataclasses import dataclass
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
#: The issue's target: this sparsity at this speedup per sparse step (CPU, "small").
TARGET = (0.75, 1.8)
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
    #: What the self-attentions did: see :class:`_AttentionProbe`.
    attention: dict[str, Any]
    #: "dense", "estimate" (masks estimated), "reuse" (masks reused), or "dense (norms
    #: exact)" where the row is that variant's.
    kind: str = "dense"
    #: The reuse variant's drift from the per-step estimate at the same sparsity.
    vs_per_step: tuple[float, float, float] | None = None


#: Where a forward's time goes: sub-modules of every block, timed by forward hooks; the
#: rest (patch embedding, norms, modulation, residuals, output) is the remainder.
SECTIONS = {"attn1": "self-attention", "attn2": "cross-attention", "ffn": "feed-forward"}


class _SectionTimer:
    """Wall time spent inside each block's attn1 / attn2 / ffn during a ``with`` block."""

    def __init__(self, model: Any, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.seconds = {label: 0.0 for label in SECTIONS.values()}
        self._handles: list[Any] = []

    def __enter__(self) -> _SectionTimer:
        from ditops.bench.harness import _sync

        for block in self.model.blocks:
            for attr, label in SECTIONS.items():
                module = getattr(block, attr)
                start: list[float] = []

                def pre(_m: Any, _a: Any, start: list[float] = start) -> None:
                    _sync(self.device)
                    start.append(time.perf_counter())

                def post(
                    _m: Any, _a: Any, _o: Any, start: list[float] = start, label: str = label
                ) -> None:
                    _sync(self.device)
                    self.seconds[label] += time.perf_counter() - start.pop()

                self._handles.append(module.register_forward_pre_hook(pre))
                self._handles.append(module.register_forward_hook(post))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()


class _AttentionProbe:
    """What the self-attentions of a forward did, timed inside it (``with`` block).

    ``estimate_s`` / ``sparse_s``: time inside the ops ``estimate_block_mask`` and
    ``block_sparse_attention``; ``dense_s``: time inside dense SDPA called from a
    block's ``attn1`` (diffusers' processor or ditops' dense steps); ``estimates``:
    estimate calls; ``densities``: the block density of each mask attention ran with.
    The device is synchronised around each, so on GPUs the parts add up to wall time.
    """

    def __init__(self, model: Any, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.estimate_s = self.sparse_s = self.dense_s = 0.0
        self.estimates = 0
        self.densities: list[float] = []
        self._inside_self_attention = 0
        self._handles: list[Any] = []
        self._sdpa: Any = None

    def _timed(self, fn: Any, add: Any) -> Any:
        from ditops.bench.harness import _sync

        def call(*args: Any, **kwargs: Any) -> Any:
            _sync(self.device)
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            _sync(self.device)
            add(time.perf_counter() - t0, args, out)
            return out

        return call

    def __enter__(self) -> _AttentionProbe:
        from ditops.ops import block_sparse_attention as bsa
        from ditops.ops import estimate_block_mask as ebm

        def enter(*_: Any) -> None:
            self._inside_self_attention += 1

        def leave(*_: Any) -> None:
            self._inside_self_attention -= 1

        for block in self.model.blocks:
            self._handles.append(block.attn1.register_forward_pre_hook(enter))
            self._handles.append(block.attn1.register_forward_hook(leave))

        def add_dense(seconds: float, _args: Any, _out: Any) -> None:
            if self._inside_self_attention:
                self.dense_s += seconds

        def add_estimate(seconds: float, _args: Any, _out: Any) -> None:
            self.estimate_s += seconds
            self.estimates += 1

        def add_sparse(seconds: float, args: Any, _out: Any) -> None:
            self.sparse_s += seconds
            self.densities.append(float(args[3].float().mean()))

        # The ops are module instances: wrap their forward for this block only.
        for op, add in ((ebm.estimate_block_mask, add_estimate),
                        (bsa.block_sparse_attention, add_sparse)):  # fmt: skip
            op.forward = self._timed(type(op).forward.__get__(op), add)
        self._sdpa = torch.nn.functional.scaled_dot_product_attention
        torch.nn.functional.scaled_dot_product_attention = self._timed(self._sdpa, add_dense)
        return self

    def __exit__(self, *exc: object) -> None:
        from ditops.ops import block_sparse_attention as bsa
        from ditops.ops import estimate_block_mask as ebm

        torch.nn.functional.scaled_dot_product_attention = self._sdpa
        for op in (ebm.estimate_block_mask, bsa.block_sparse_attention):
            del op.forward
        for h in self._handles:
            h.remove()

    def as_dict(self) -> dict[str, Any]:
        return {
            "estimate_s": self.estimate_s,
            "sparse_s": self.sparse_s,
            "dense_s": self.dense_s,
            "attention_s": self.sparse_s + self.dense_s,
            "estimates": self.estimates,
            "density": (sum(self.densities) / len(self.densities) if self.densities else None),
            "densities": self.densities,
        }


def _forward(
    model: Any,
    latents: torch.Tensor,
    timesteps: torch.Tensor,
    text: torch.Tensor,
    step: int,
    n_steps: int,
    device: torch.device,
) -> tuple[torch.Tensor, float]:
    """One denoiser call at ``step``, inside the cache context a diffusers pipeline sets."""
    from ditops.bench.harness import _sync

    with (
        torch.inference_mode(),
        model.cache_context("cond", step_index=step, num_inference_steps=n_steps),
    ):
        _sync(device)
        t0 = time.perf_counter()
        out = model(
            hidden_states=latents,
            timestep=timesteps[step : step + 1],
            encoder_hidden_states=text,
            return_dict=False,
        )[0]
        _sync(device)
        return out, time.perf_counter() - t0


def _drift(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float]:
    from ditops.bench.harness import drift

    return drift(out, ref)


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


def _sparse(sparsity: float, estimate_every: int = 1) -> Any:
    from ditops.attention.schedule import BlockSparseConfig

    return BlockSparseConfig(
        sparsity=sparsity, skip_first_steps=SKIP_FIRST_STEPS, estimate_every=estimate_every
    )


def _variants() -> list[tuple[str, dict[str, Any] | None]]:
    sparse = [(f"sparse {s}", {"precision": "exact", "attention": _sparse(s)}) for s in SPARSITIES]
    reuse = (
        f"sparse {REUSE_SPARSITY} /{REUSE_EVERY}",
        {"precision": "exact", "attention": _sparse(REUSE_SPARSITY, REUSE_EVERY)},
    )
    return [("unpatched", None), ("norms exact", {"precision": "exact"}), *sparse, reuse]


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
    fallback (:func:`cpu_warning`): the same work, measured in minutes rather than hours."""
    return torch.float32 if cpu_warning(device, torch.bfloat16) else torch.bfloat16


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
) -> dict[str, Any]:
    """Run the loop for every variant; returns rows and a summary (see module docstring)."""
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
        with _SectionTimer(target, device) as sections, _AttentionProbe(target, device) as att:
            out, seconds = _forward(target, x, timesteps, text, step, n_steps, device)
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
            cfg_ = _config_of(options)
            if cfg_ is not None and cfg_.estimate_every > 1:
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
                # The faster of the repeats: one noisy call moves a forward by 10%.
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
    summary = _summary(rows, n_steps)
    if plot_path:
        _plot(rows, summary, plot_path)
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
        "summary": summary,
        "target": {"sparsity": TARGET[0], "speedup_per_sparse_step": TARGET[1]},
    }


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or not den else num / den


def _summary(rows: list[dict[str, Any]], n_steps: int) -> list[dict[str, Any]]:
    """Per variant: speedups over all steps and over the sparse steps alone (after an
    untimed warm-up call), where the sparse steps' time goes (estimate, attention, the
    dense attention they replace), realised densities, the worst drift, and the mean
    time per section."""
    out = []
    base = {r["step"]: r["seconds"] for r in rows if r["variant"] == "unpatched"}
    for name in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == name]
        sparse_steps = [r for r in mine if not r["dense"]]
        att = [r["attention"] for r in sparse_steps]
        densities = [d for a in att for d in a["densities"]]
        requested = mine[0]["requested_density"]
        estimate_s = _mean([a["estimate_s"] for a in att])
        attention_s = _mean([a["attention_s"] for a in att])
        dense_attention_s = _mean([r["dense_attention_s"] for r in sparse_steps])
        reuse = [r["vs_per_step"] for r in sparse_steps if r["vs_per_step"] is not None]
        out.append(
            {
                "variant": name,
                "speedup_per_forward": sum(base[r["step"]] for r in mine)
                / sum(r["seconds"] for r in mine),
                "speedup_sparse_steps": (
                    sum(base[r["step"]] for r in sparse_steps)
                    / sum(r["seconds"] for r in sparse_steps)
                    if sparse_steps
                    else None
                ),
                "requested_density": requested,
                "realised_density": _mean(densities),
                "density_error": (
                    max(abs(d - requested) for d in densities) if densities else None
                ),
                "estimated_steps": sum(1 for r in sparse_steps if r["kind"] == "estimate"),
                "sparse_steps": len(sparse_steps),
                "estimate_s": estimate_s,
                "attention_s": attention_s,
                "dense_attention_s": dense_attention_s,
                "attention_speedup": _ratio(dense_attention_s, attention_s),
                "attention_with_estimate_speedup": _ratio(
                    dense_attention_s,
                    None if attention_s is None else attention_s + (estimate_s or 0.0),
                ),
                "estimate_share_of_dense_attention": _ratio(estimate_s, dense_attention_s),
                "max_abs": max(r["max_abs"] for r in mine),
                "min_cosine": min(r["cosine"] for r in mine),
                "min_psnr": min(r["psnr"] for r in mine),
                "bitwise_equal": all(r["max_abs"] == 0 for r in mine),
                "vs_per_step": (
                    {
                        "max_abs": max(x[0] for x in reuse),
                        "min_cosine": min(x[1] for x in reuse),
                        "min_psnr": min(x[2] for x in reuse),
                    }
                    if reuse
                    else None
                ),
                "mean_sections": {
                    label: sum(r["sections"][label] for r in mine) / len(mine)
                    for label in SECTIONS.values()
                },
                "mean_seconds": sum(r["seconds"] for r in mine) / len(mine),
                "sparse_step_seconds": _mean([r["seconds"] for r in sparse_steps]),
                "sparse_step_sections": (
                    {
                        label: sum(r["sections"][label] for r in sparse_steps) / len(sparse_steps)
                        for label in SECTIONS.values()
                    }
                    if sparse_steps
                    else None
                ),
            }
        )
    return out


def _f(value: Any, spec: str) -> str:
    """``value`` formatted, or a dash for a missing one (right-aligned to the width)."""
    width = spec.split(".")[0].lstrip("<>") or "0"
    if value is None:
        return "-".rjust(int(width))
    return format(value, spec)


def print_report(result: dict[str, Any], out: Any = sys.stdout) -> None:
    machine = result.get("machine", {})
    print(
        f"\n== wan: {result['video_tokens']} video tokens ({result.get('size_name', '')}), "
        f"latent {result['latent_shape']}, {result['config']['num_layers']} layers, "
        f"{result.get('dtype', 'bfloat16')}, {result['steps']} steps "
        f"({result['skip_first_steps']} dense first), faster of {result.get('repeats', REPEATS)} "
        f"calls per step",
        file=out,
    )
    if machine:
        print(
            f"machine: {machine.get('processor') or machine.get('machine')}, "
            f"{machine.get('threads')} threads, {machine.get('cpu_features', '')}, "
            f"torch {machine.get('torch')}, device {machine.get('device')}",
            file=out,
        )
    print(
        f"{'variant':<16} {'step':>4} {'kind':<8} {'s/forward':>9} {'speedup':>7} "
        f"{'est s':>6} {'attn s':>7} {'density':>7} {'max abs':>9} {'cosine':>9} {'PSNR dB':>7}",
        file=out,
    )
    for r in result["rows"]:
        a = r["attention"]
        kind = "(=norms)" if r["kind"].startswith("dense (") else r["kind"]
        print(
            f"{r['variant']:<16} {r['step']:>4} {kind:<8} {r['seconds']:>9.2f} "
            f"{r['speedup']:>7.2f} {a['estimate_s']:>6.2f} {a['attention_s']:>7.2f} "
            f"{_f(a['density'], '7.3f')} {r['max_abs']:>9.2e} {r['cosine']:>9.6f} "
            f"{r['psnr']:>7.1f}",
            file=out,
        )
    method = result.get("mask_method")
    how = f", mask method {method['method']!r}, samples {method['samples']}" if method else ""
    print(
        f"\nsparse steps, per forward ({result['config']['num_layers']} self-attentions{how}): "
        "density asked/run, estimate and attention time, speedups of the attention alone "
        "(without / with the estimate) and of the whole step, against the unpatched model",
        file=out,
    )
    print(
        f"{'variant':<16} {'asked':>5} {'run':>6} {'|err|':>6} {'est/st':>6} {'est s':>6} "
        f"{'attn s':>7} {'dense s':>7} {'est %':>6} {'attn x':>6} {'+est x':>6} "
        f"{'step x':>6} {'all x':>6} {'min cos':>9} {'minPSNR':>7}",
        file=out,
    )
    for s in result["summary"]:
        est_steps = f"{s['estimated_steps']}/{s['sparse_steps']}" if s["sparse_steps"] else None
        share = s["estimate_share_of_dense_attention"]
        cells = [
            (s["requested_density"], "5.2f"),
            (s["realised_density"], "6.3f"),
            (s["density_error"], "6.3f"),
            (est_steps, ">6"),
            (s["estimate_s"], "6.2f"),
            (s["attention_s"], "7.2f"),
            (s["dense_attention_s"], "7.2f"),
            (None if share is None else 100 * share, "6.1f"),
            (s["attention_speedup"], "6.2f"),
            (s["attention_with_estimate_speedup"], "6.2f"),
            (s["speedup_sparse_steps"], "6.2f"),
            (s["speedup_per_forward"], "6.2f"),
            (s["min_cosine"], "9.6f"),
            (s["min_psnr"], "7.1f"),
        ]
        print(f"{s['variant']:<16} " + " ".join(_f(v, spec) for v, spec in cells), file=out)
    for s in result["summary"]:
        if s["vs_per_step"] is not None:
            v = s["vs_per_step"]
            print(
                f"{s['variant']}: against estimating at every step (same sparsity, same "
                f"inputs): max abs {v['max_abs']:.2e}, min cosine {v['min_cosine']:.6f}, "
                f"min PSNR {v['min_psnr']:.1f} dB",
                file=out,
            )
    target = result.get("target") or {}
    sparsity = target.get("sparsity", TARGET[0])
    want = target.get("speedup_per_sparse_step", TARGET[1])
    for s in result["summary"]:
        requested = s["requested_density"]
        if requested is not None and abs(1 - requested - sparsity) < 1e-9:
            got = s["speedup_sparse_steps"]
            met = got is not None and got >= want
            print(
                f"target: sparsity {sparsity} at >= {want}x per sparse step against the "
                f"unpatched model ({s['variant']}): {_f(got, '.2f')}x, "
                f"{'met' if met else 'not met'}",
                file=out,
            )
            break
    print("\nwhere the time goes (mean seconds per forward; sparse variants: sparse steps):",
          file=out)  # fmt: skip
    for s in result["summary"]:
        sections = s["sparse_step_sections"] or s["mean_sections"]
        total = s["sparse_step_seconds"] or s["mean_seconds"]
        parts = ", ".join(f"{k} {v:.2f}" for k, v in sections.items())
        rest = total - sum(sections.values())
        inner = ""
        if s["attention_s"] is not None:
            inner = (
                f" (self-attention: estimate {s['estimate_s']:.2f}, attention "
                f"{s['attention_s']:.2f})"
            )
        print(f"  {s['variant']:<16} {parts}, rest {rest:.2f}{inner}", file=out)
    warm = ", ".join(f"{k} {v:.1f} s" for k, v in result["warmup_seconds"].items())
    print(f"untimed warm-up calls (compiles included): {warm}", file=out)
    print(
        "asked/run: block density asked for (1 - sparsity) and realised (mean over layers and "
        "sparse steps); |err|: the largest difference at any call. est/st: sparse steps "
        "that estimated masks. dense s: the unpatched model's attention time at those steps; "
        "est %: the estimate as a share of it. attn x / +est x: the attention alone, without "
        "and with the estimate; step x: the whole forward on the sparse steps; all x: over "
        "every step. Drift (cos, PSNR) against the unpatched model at equal inputs.",
        file=out,
    )


def _plot(rows: list[dict[str, Any]], summary: list[dict[str, Any]], path: str) -> None:
    """Left: time per step and variant. Right: where a sparse step's time goes."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "ditops bench: matplotlib is not installed; no plot (pip install 'ditops[bench]')",
            file=sys.stderr,
        )
        return
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.8))
    for name in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == name]
        ax.plot([r["step"] for r in mine], [r["seconds"] for r in mine], marker="o", label=name)
    ax.axvspan(-0.5, SKIP_FIRST_STEPS - 0.5, color="0.9", label="dense steps")
    ax.set_xlabel("denoising step")
    ax.set_ylabel("seconds per forward")
    ax.set_title("Time per step")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    names = [s["variant"] for s in summary]
    bottom = [0.0] * len(names)
    parts: dict[str, list[float]] = {}
    for s in summary:
        sections = s["sparse_step_sections"] or s["mean_sections"]
        total = s["sparse_step_seconds"] or s["mean_seconds"]
        est = s["estimate_s"] or 0.0
        attn = s["attention_s"] if s["attention_s"] is not None else None
        if attn is None:  # dense variants: their SDPA time, from the rows
            mine = [r["attention"]["attention_s"] for r in rows if r["variant"] == s["variant"]]
            attn = sum(mine) / len(mine)
        values = {
            "self-attention: estimate": est,
            "self-attention: attention kernel": attn,
            "self-attention: projections, rope": sections["self-attention"] - est - attn,
            "cross-attention": sections["cross-attention"],
            "feed-forward": sections["feed-forward"],
            "norms, modulation, rest": total - sum(sections.values()),
        }
        for label, value in values.items():
            parts.setdefault(label, []).append(max(value, 0.0))
    for label, values in parts.items():
        bx.bar(names, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    bx.set_ylabel("seconds per forward (sparse steps)")
    bx.set_title("Where the time goes")
    bx.tick_params(axis="x", labelrotation=20, labelsize=8)
    bx.legend(fontsize=7)
    fig.suptitle("Wan forward, unpatched vs ditops (ditops bench)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
