"""How a video DiT forward's cost grows with the video, and what sparse attention buys.

``python -m ditops.bench.video_scaling [--family hunyuan_video|wan|ltx_video|cogvideox] [--tokens
8192 16384
32768] [--sparsity 0.75]`` builds a one-block model of the family's geometry and, per video
length (latent frames of 16 x 24 tokens, the nearest whole number of frames), times
unpatched and ``exact`` + block-sparse attention in turns: the forward, the attention
module(s) timed and their share of the forward.

* ``hunyuan_video`` (the default): one double-stream block, head dim 128, 4 heads
  (:mod:`ditops.bench.hunyuan_video`'s small config otherwise), 64 text tokens; the
  attention module is the joint attention (q/k/v projections, prologue, attention,
  output projections).
* ``wan``: a one-layer ``WanTransformer3DModel`` of Wan2.1's geometry (12 heads of 128,
  dim 1536, ffn 8960, patch (1, 2, 2); text_dim 512 to keep it cheap, built by
  :func:`ditops.bench.wan_model.build_model`), 512 text tokens; the module timed is the
  **self-attention** ``attn1`` alone (projections, q/k norm and rope, attention, output):
  the cross-attention to the text counts in the rest.
* ``ltx_video``: a one-block ``LTXVideoTransformer3DModel`` of LTX-Video's geometry (32
  heads of 64, patch 1; frames of 16 x 24 tokens, its 768 x 512 frame), 128 text tokens;
  the module timed is the self-attention ``attn1``.
* ``cogvideox``: a one-block ``CogVideoXTransformer3DModel`` of CogVideoX-5B's geometry
  in the 1.0 layout (head dim 64, 4 heads, :mod:`ditops.bench.cogvideox`'s small config),
  226 text tokens first; the module timed is the joint attention ``attn1``.

Then a **projection, not a measurement**: the unpatched attention time is fitted as
``a * N^2`` and the rest as ``b * N`` (least squares over the lengths measured), the
sparse attention module's speedup is taken from the longest length measured, and
Amdahl's law gives the forward's speedup at the family's 480p and 720p token counts
(HunyuanVideo, 129 frames: 33 latent frames of 30 x 53 and of 45 x 80 tokens; Wan, 81
frames: 21 latent frames of 30 x 52 and of 45 x 80 tokens; LTX-Video, 121 frames: 16
latent frames of 16 x 24 and of 22 x 38 tokens; CogVideoX-5B at 49 frames of 720 x 480:
13 latent frames of 30 x 45 tokens, CogVideoX1.5-5B at 81 frames of 1360 x 768: 11 token
frames of 48 x 85, temporal patch 2).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ditops.bench import cogvideox as cv
from ditops.bench import hunyuan_video as hv
from ditops.bench import ltx_video as ltx
from ditops.bench import wan, wan_model
from ditops.bench.model_runs import SparseAttentionProbe, timed_forward
from ditops.bench.sparse_video import default_dtype

FRAME = (32, 48)  # latent height, width: 16 x 24 tokens per frame after patch 2
#: HunyuanVideo's video tokens at 129 frames (33 latent frames), 480p and 720p.
TARGETS = {"480p (848x480)": 33 * 30 * 53, "720p (1280x720)": 33 * 45 * 80}
#: Wan's video tokens at 81 frames (21 latent frames), 480p and 720p.
WAN_TARGETS = {"480p (832x480)": 21 * 30 * 52, "720p (1280x720)": 21 * 45 * 80}
#: LTX-Video's tokens at 121 frames (16 latent frames; VAE 32 x 32 x 8, patch 1).
LTX_TARGETS = {"512p (768x512)": 16 * 16 * 24, "704p (1216x704)": 16 * 22 * 38}
#: CogVideoX-5B's video tokens at 49 frames, 720x480; CogVideoX1.5-5B's at 81, 1360x768.
COGVIDEOX_TARGETS = {"1.0 (720x480)": 13 * 30 * 45, "1.5 (1360x768)": 11 * 48 * 85}


@dataclass(frozen=True)
class Family:
    """What differs between the families: the model, its inputs and what is timed."""

    #: the report's words for the model (geometry, blocks, what the attention column holds)
    model: str
    #: the model config from keyword overrides
    config: Callable[[dict[str, Any]], dict[str, Any]]
    build: Callable[[torch.device, torch.dtype, dict[str, Any]], Any]
    #: ``(config, (frames, height, width), text_tokens, device, dtype)`` -> forward kwargs
    inputs: Callable[..., dict[str, torch.Tensor]]
    #: the attention modules timed
    attention: Callable[[Any], list[Any]]
    #: the latent patch (height, width)
    patch: Callable[[dict[str, Any]], tuple[int, int]]
    default_dtype: Callable[[torch.device], torch.dtype]
    targets: dict[str, int]
    text_tokens: int
    #: a latent frame (height, width)
    frame: tuple[int, int] = FRAME


def _wan_patch(config: dict[str, Any]) -> tuple[int, int]:
    if config["patch_size"][0] != 1:
        raise ValueError("video_scaling: wan needs a temporal patch of 1")
    return config["patch_size"][1], config["patch_size"][2]


FAMILIES: dict[str, Family] = {
    "hunyuan_video": Family(
        model="HunyuanVideo geometry, 1 double-stream block",
        config=lambda o: {
            **hv.BASE_CONFIG,
            **hv.SIZES["small"]["config"],
            "num_single_layers": 0,
            **o,
        },
        build=hv.BENCH.build,
        inputs=hv.make_inputs,
        attention=hv.attentions,
        patch=lambda config: (config["patch_size"], config["patch_size"]),
        default_dtype=default_dtype,
        targets=TARGETS,
        text_tokens=64,
    ),
    "wan": Family(
        model="Wan2.1 geometry, 1 layer; attn: self-attention (attn1) only, cross-attention "
        "in the rest",
        config=lambda o: {**wan_model.DEFAULT_CONFIG, "num_layers": 1, "text_dim": 512, **o},
        build=lambda device, dtype, config: wan_model.build_model(None, device, dtype, **config),
        inputs=wan_model.make_inputs,
        attention=lambda model: [b.attn1 for b in model.blocks],
        patch=_wan_patch,
        default_dtype=wan_model.default_dtype,
        targets=WAN_TARGETS,
        text_tokens=wan.TEXT_TOKENS,
    ),
    "ltx_video": Family(
        model="LTX-Video geometry (32 heads of 64), 1 block; attn: self-attention (attn1) "
        "only, cross-attention in the rest",
        config=lambda o: {**ltx.BASE_CONFIG, **ltx.SIZES["full"]["config"], "num_layers": 1, **o},
        build=ltx.BENCH.build,
        inputs=ltx.make_inputs,
        attention=ltx.self_attentions,
        patch=lambda config: (config["patch_size"], config["patch_size"]),
        default_dtype=default_dtype,
        targets=LTX_TARGETS,
        text_tokens=128,
        frame=(16, 24),  # LTX-Video's 768 x 512 frame: 384 tokens
    ),
    "cogvideox": Family(
        model="CogVideoX-5B geometry (1.0 layout), 1 block",
        config=lambda o: {**cv.BASE_CONFIG, **cv.SIZES["small"]["config"], **o},
        build=cv.BENCH.build,
        inputs=lambda config, latent, text, device, dtype: cv.make_inputs(
            {**config, "max_text_seq_length": text}, latent, device, dtype
        ),
        attention=lambda model: [b.attn1 for b in model.transformer_blocks],
        patch=lambda config: (config["patch_size"], config["patch_size"]),
        default_dtype=default_dtype,
        targets=COGVIDEOX_TARGETS,
        text_tokens=226,
    ),
}


def _fit(ns: list[int], ts: list[float], power: int) -> float:
    """Least-squares ``c`` of ``t = c * n^power``."""
    return sum(t * n**power for n, t in zip(ns, ts)) / sum(n ** (2 * power) for n in ns)


def run(
    device: torch.device,
    tokens: tuple[int, ...] = (8192, 16384, 32768),
    *,
    family: str = "hunyuan_video",
    sparsity: float = 0.75,
    rounds: int = 1,
    text_tokens: int | None = None,
    block_size: int = 128,
    frame: tuple[int, int] | None = None,
    dtype: torch.dtype | None = None,
    progress: bool = True,
    **overrides: Any,
) -> dict[str, Any]:
    """Measure each length (see the module docstring); ``text_tokens`` None: the family's
    (64, Wan 512); ``frame`` None: the family's latent frame; ``overrides`` replace entries
    of the model config."""
    from ditops.attention.schedule import BlockSparseConfig
    from ditops.bench.harness import Progress
    from ditops.integrations import patch, unpatch

    if family not in FAMILIES:
        raise ValueError(f"video_scaling: family must be one of {sorted(FAMILIES)}, got {family!r}")
    fam = FAMILIES[family]
    frame = fam.frame if frame is None else frame
    text_tokens = fam.text_tokens if text_tokens is None else text_tokens
    dtype = fam.default_dtype(device) if dtype is None else dtype
    config = fam.config(overrides)
    model = fam.build(device, dtype, config)
    ph, pw = fam.patch(config)
    per_frame = (frame[0] // ph) * (frame[1] // pw)
    sparse_cfg = BlockSparseConfig(sparsity=sparsity, block_size=block_size)
    variants: list[tuple[str, BlockSparseConfig | None]] = [
        ("unpatched", None),
        ("sparse", sparse_cfg),
    ]
    bar = Progress(len(tokens) * len(variants) * (rounds + 1), "video_scaling", progress)
    rows = []
    try:
        for wanted in tokens:
            frames = max(1, round(wanted / per_frame))
            x = fam.inputs(config, (frames, *frame), text_tokens, device, dtype)
            fwd: dict[str, list[float]] = {n: [] for n, _ in variants}
            attn: dict[str, list[float]] = {n: [] for n, _ in variants}
            for r in range(-1, rounds):  # round -1: untimed warm-up
                for name, cfg in variants:
                    bar.step(f"{frames * per_frame} tokens, {name}, round {r}")
                    unpatch(model)
                    if cfg is not None:
                        patch(model, precision="exact", attention=cfg)
                    probe = SparseAttentionProbe(device, fam.attention(model))
                    try:
                        _, seconds = timed_forward(model, x, device)
                    finally:
                        probe.remove()
                    if r >= 0:
                        fwd[name].append(seconds)
                        attn[name].append(probe.seconds)
            f_u, a_u = statistics.median(fwd["unpatched"]), statistics.median(attn["unpatched"])
            f_s, a_s = statistics.median(fwd["sparse"]), statistics.median(attn["sparse"])
            rows.append(
                {
                    "video_tokens": frames * per_frame,
                    "frames": frames,
                    "forward_s": f_u,
                    "attention_s": a_u,
                    "attention_share": a_u / f_u,
                    "sparse_forward_s": f_s,
                    "sparse_attention_s": a_s,
                    "attention_speedup": a_u / a_s,
                    "forward_speedup": f_u / f_s,
                }
            )
    finally:
        bar.close()
        unpatch(model)
    return {
        "family": family,
        "model": fam.model,
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in config.items()},
        "dtype": str(dtype).replace("torch.", ""),
        "sparsity": sparsity,
        "text_tokens": text_tokens,
        "rounds": rounds,
        "rows": rows,
        "projection": project(rows, fam.targets),
    }


def project(
    rows: list[dict[str, Any]], targets: dict[str, int] | None = None
) -> list[dict[str, Any]]:
    """Amdahl's law at ``targets`` (None: :data:`TARGETS`) from the fitted costs (see the
    module docstring)."""
    ns = [r["video_tokens"] for r in rows]
    a = _fit(ns, [r["attention_s"] for r in rows], 2)
    b = _fit(ns, [r["forward_s"] - r["attention_s"] for r in rows], 1)
    speedup = max(rows, key=lambda r: r["video_tokens"])["attention_speedup"]
    out = []
    for label, n in (TARGETS if targets is None else targets).items():
        share = a * n * n / (a * n * n + b * n)
        out.append(
            {
                "target": label,
                "video_tokens": n,
                "attention_share": share,
                "attention_speedup": speedup,
                "forward_speedup": 1 / ((1 - share) + share / speedup),
            }
        )
    return out


def print_report(result: dict[str, Any], out: Any = None) -> None:
    out = sys.stdout if out is None else out
    cfg = result["config"]
    print(
        f"\n== video scaling ({result.get('model', FAMILIES['hunyuan_video'].model)}, "
        f"{cfg['num_attention_heads']} heads of {cfg['attention_head_dim']}, {result['dtype']}, "
        f"+{result['text_tokens']} text tokens; sparse: exact + sparsity {result['sparsity']}, "
        f"{result['rounds']} round(s)) -- measured",
        file=out,
    )
    print(
        f"{'video tokens':>12} {'s/forward':>9} {'attn s':>7} {'attn share':>10} "
        f"{'sparse attn s':>13} {'x attn':>6} {'x forward':>9}",
        file=out,
    )
    for r in result["rows"]:
        print(
            f"{r['video_tokens']:>12} {r['forward_s']:>9.2f} {r['attention_s']:>7.2f} "
            f"{r['attention_share']:>10.2f} {r['sparse_attention_s']:>13.2f} "
            f"{r['attention_speedup']:>6.2f} {r['forward_speedup']:>9.2f}",
            file=out,
        )
    print(
        "-- PROJECTION, not a measurement: attention a*N^2 and the rest b*N fitted above, "
        "the attention speedup of the longest video measured, Amdahl's law:",
        file=out,
    )
    for p in result["projection"]:
        print(
            f"{p['target']:>16}: {p['video_tokens']} video tokens, attention share "
            f"{p['attention_share']:.2f}, x attention {p['attention_speedup']:.2f} -> "
            f"x forward {p['forward_speedup']:.2f}",
            file=out,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ditops.bench.video_scaling")
    parser.add_argument("--family", choices=sorted(FAMILIES), default="hunyuan_video")
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--sparsity", type=float, default=0.75)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    from ditops.bench.harness import machine_info, write_json

    device = torch.device(args.device)
    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    result = run(
        device,
        tuple(args.tokens),
        family=args.family,
        sparsity=args.sparsity,
        rounds=args.rounds,
        dtype=dtype,
        progress=not args.no_progress,
    )
    print_report(result)
    if args.json:
        write_json(args.json, {"machine": machine_info(device), **result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
