"""Seconds per denoising step of sglang's whole pipelines on the tiny checkpoints, stock
against ditops, one run at a time, variants interleaved per repeat (not a test: the
quiet-machine figures of ``benchmarks/README.md``, issue 38).

``python -m tests.sglang.pipeline_times [--steps N] [--repeats R] [--only NAME ...]``
from the repository root in sglang's environment. Each run is ``run_generator.py`` in a
process of its own (sglang's scheduler and workers); a step's time is the difference of
the generate times at ``N`` and 1 step over ``N - 1`` (start-up, text encoding and
decoding cancel), the best of the repeats. Stock runs only where it runs on the host
(FLUX.1, FLUX.2-klein and Z-Image on a CPU); the video pipelines run ditops dense and sparse (causal
Wan dense only: it refuses ``block_sparse_attn``), Qwen-Image ditops.
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
from pathlib import Path

from tests.sglang.test_pipelines import SPARSE, run_all
from tests.sglang.tiny_images import (
    write_tiny_flux,
    write_tiny_flux2_klein,
    write_tiny_qwen_image,
    write_tiny_zimage,
)
from tests.sglang.tiny_video import write_tiny_hunyuan_video
from tests.sglang.tiny_wan import write_tiny_causal_wan, write_tiny_wan

#: name -> (writer, extra env, variants: (label, ditops on, extra argv)).
PIPELINES = {
    "flux1": (write_tiny_flux, {"RUN_GENERATOR_KIND": "image"},
              [("stock", False, []), ("ditops", True, [])]),
    "flux2-klein": (write_tiny_flux2_klein, {"RUN_GENERATOR_KIND": "image"},
                    [("stock", False, []), ("ditops", True, [])]),
    "zimage": (write_tiny_zimage, {"RUN_GENERATOR_KIND": "image"},
               [("stock", False, []), ("ditops", True, [])]),
    "qwen-image": (write_tiny_qwen_image, {"RUN_GENERATOR_KIND": "image"},
                   [("ditops", True, [])]),
    "wan2.1-t2v": (write_tiny_wan, {}, [("ditops", True, []), ("sparse", True, SPARSE)]),
    "hunyuanvideo": (write_tiny_hunyuan_video, {},
                     [("ditops", True, []), ("sparse", True, SPARSE)]),
    "causal-wan": (write_tiny_causal_wan, {}, [("ditops", True, [])]),
}  # fmt: skip


def generate_seconds(log: str) -> float:
    return float(re.search(r"generate ([0-9.]+) s", log).group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--only", nargs="*", default=list(PIPELINES))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        best: dict[str, float] = {}
        for name in args.only:
            writer, env, variants = PIPELINES[name]
            checkpoint = writer(root)
            for _ in range(args.repeats):
                for label, on, argv in variants:
                    times = {}
                    for steps in (1, args.steps):
                        extra = {**env, "RUN_GENERATOR_STEPS": str(steps)}
                        out = root / f"{name}-{label}.npy"
                        run = {label: (checkpoint, out, on, extra, argv)}
                        times[steps] = generate_seconds(run_all(run)[label])
                    per_step = (times[args.steps] - times[1]) / (args.steps - 1)
                    key = f"{name} {label}"
                    best[key] = min(best.get(key, per_step), per_step)
        load = os.getloadavg()[0]
        print(f"sglang pipelines, s/step (best of {args.repeats}), load {load:.1f} at the end")
        for key, seconds in best.items():
            print(f"  {key:<24} {seconds:8.3f}")


if __name__ == "__main__":
    main()
