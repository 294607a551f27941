"""``ditops bench --quick``: a first success in under a minute, offline.

1. A tiny ``WanPipeline`` (:mod:`ditops.bench.tiny`: random weights built in memory)
   makes a short video unpatched and again after ``ditops.patch(pipe, precision="exact")``:
   the frames are compared bit for bit.
2. The same pipeline with a one-layer transformer of Wan's head size (heads of 128) on a
   Wan-like latent (21 frames of 16 x 24 tokens: 8064 video tokens) runs its denoising
   steps unpatched, then with block-sparse self-attention after one dense step; each
   transformer call is timed, and the sparse steps' block density and speedup over the
   same steps unpatched are printed, with the drift of the final latents.

Then it says what to run next. The main job, ``ditops bench``, measures the same things
on a 2-layer model of Wan2.1-1.3B's width, variants interleaved, with a report and a plot.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

from ditops.bench.tiny import TINY_CALL, tiny_wan_pipeline

PROMPT = "a cat surfing in the snow"
BITWISE_STEPS = 4
#: Part 2: latent frames, height and width in pixels (VAE factor 8, patch 2: 16 x 24 tokens).
SPEED_CALL: dict[str, Any] = {"num_frames": 81, "height": 256, "width": 384}
SPEED_STEPS = 3
HEADS = 2
SPARSITY = 0.75
NEXT = (
    "next: ditops bench        the main job: a 2-layer Wan2.1-1.3B-wide model, variants "
    "interleaved, report and plot (minutes)\n"
    "      ditops info         which path each op takes on this machine, and why\n"
    "      ditops tune         time the paths for a model's shapes ahead (docs/tuning.md)\n"
    "      docs/getting-started.md and docs/usage.md: ditops.patch on your own pipeline"
)


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


class _CallTimer:
    """Wall time of each transformer call while active (forward pre/post hooks)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seconds: list[float] = []
        self._start = 0.0
        self._handles = [
            model.register_forward_pre_hook(lambda *_: self._begin()),
            model.register_forward_hook(lambda *_: self._end()),
        ]

    def _begin(self) -> None:
        self._start = time.perf_counter()

    def _end(self) -> None:
        self.seconds.append(time.perf_counter() - self._start)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def bitwise(dtype: torch.dtype) -> dict[str, Any]:
    """Part 1: frames of the tiny pipeline, unpatched and patched exact, compared."""
    import ditops.integrations as patching

    pipe = tiny_wan_pipeline(dtype)
    call = {**TINY_CALL, "num_inference_steps": BITWISE_STEPS, "output_type": "pt"}
    with torch.inference_mode():
        before = pipe(PROMPT, generator=_generator(), **call).frames
        report = patching.patch(pipe, precision="exact")
        after = pipe(PROMPT, generator=_generator(), **call).frames
    return {
        "report": str(report).replace("\n", "; "),
        "frames": list(before.shape),
        "bitwise_equal": bool(torch.equal(before, after)),
    }


def video_tokens(call: dict[str, Any]) -> int:
    """Tokens of a Wan call: 4x temporal and 8x spatial VAE compression, 2x2 patches."""
    return ((call["num_frames"] - 1) // 4 + 1) * (call["height"] // 16) * (call["width"] // 16)


def sparse_speed(dtype: torch.dtype) -> dict[str, Any]:
    """Part 2: per-call times of the wider pipeline, unpatched and sparse, and densities."""
    import ditops.integrations as patching
    from ditops.attention.schedule import BlockSparseConfig
    from ditops.bench.accuracy import drift
    from ditops.bench.wan_probes import AttentionProbe

    pipe = tiny_wan_pipeline(dtype, layers=1, heads=HEADS, head_dim=128)
    call = {**SPEED_CALL, "num_inference_steps": SPEED_STEPS, "guidance_scale": 1.0}
    call["output_type"] = "latent"
    model = pipe.transformer
    runs: dict[str, Any] = {}
    probe = AttentionProbe(model, torch.device("cpu"))
    for name in ("unpatched", "sparse"):
        if name == "sparse":
            config = BlockSparseConfig(sparsity=SPARSITY, skip_first_steps=1)
            patching.patch(pipe, precision="exact", attention=config)
        timer = _CallTimer(model)
        try:
            with torch.inference_mode(), probe:
                latents = pipe(PROMPT, generator=_generator(), **call).frames
        finally:
            timer.remove()
        runs[name] = (timer.seconds, latents)
    plain, sparse = runs["unpatched"][0][1:], runs["sparse"][0][1:]  # the sparse steps
    max_abs, cosine, psnr = drift(runs["sparse"][1].float(), runs["unpatched"][1].float())
    return {
        "video_tokens": video_tokens(SPEED_CALL),
        "sparse_steps": len(sparse),
        "density": sum(probe.densities) / max(len(probe.densities), 1),
        "unpatched_s": sum(plain) / len(plain),
        "sparse_s": sum(sparse) / len(sparse),
        "speedup": sum(plain) / sum(sparse),
        "psnr": psnr,
        "cosine": cosine,
        "max_abs": max_abs,
    }


def run(out: Any = None) -> dict[str, Any]:
    """Both parts, printed as they finish; returns the figures (``--json``)."""
    from ditops import config

    out = out or sys.stdout
    t0 = time.perf_counter()
    # The static choice of paths: timing every candidate first (DITOPS_TUNE=on) would
    # compile FlexAttention for a shape seen once, longer than the whole run.
    with config.override(tune="off"):
        return _run(out, t0)


def _run(out: Any, t0: float) -> dict[str, Any]:
    from ditops.bench.wan_model import default_dtype

    dtype = default_dtype(torch.device("cpu"))
    name = str(dtype).removeprefix("torch.")
    print(f"ditops bench --quick: tiny pipelines built offline (random weights), {name}", file=out)
    first = bitwise(dtype)
    same = "bitwise equal" if first["bitwise_equal"] else "NOT bitwise equal (please report)"
    print(f"1. tiny WanPipeline, {BITWISE_STEPS} steps, frames {first['frames']}", file=out)
    print(f"   ditops.patch(pipe, precision='exact'): {first['report']}", file=out)
    print(f"   frames unpatched vs patched: {same}", file=out)
    # float32: bf16 would take compiled FlexAttention on CPUs with AVX-512-BF16 or AMX,
    # whose first call compiles for longer than this whole run.
    second = sparse_speed(torch.float32)
    print(
        f"2. one layer of {HEADS} heads of 128 (Wan's head size), float32, "
        f"{second['video_tokens']} video tokens, "
        f"{SPEED_STEPS} steps, sparse after step 0:\n"
        f"   BlockSparseConfig(sparsity={SPARSITY}): block density "
        f"{second['density']:.3f} on the {second['sparse_steps']} sparse steps\n"
        f"   per transformer call: unpatched {second['unpatched_s']:.2f} s, sparse "
        f"{second['sparse_s']:.2f} s: {second['speedup']:.2f}x "
        f"(latents' PSNR {second['psnr']:.1f} dB, cosine {second['cosine']:.5f})",
        file=out,
    )
    seconds = time.perf_counter() - t0
    print(f"done in {seconds:.0f} s\n{NEXT}", file=out)
    return {"dtype": name, "bitwise": first, "sparse": second, "seconds": seconds}
