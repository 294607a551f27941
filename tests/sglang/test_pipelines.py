"""sglang's whole pipelines (``DiffGenerator``: its scheduler and worker processes) on tiny
checkpoints written here, stock and with ditops' plugin: the image pipelines stock sglang
runs on a CPU (FLUX.1, Z-Image) give stock's frames with ditops; each ditops run says
which of sglang's ops it bound to ditops. Runs go two at a time (mostly start-up)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.sglang.tiny_images import write_tiny_flux, write_tiny_zimage

HERE = Path(__file__).parent
ROOT = HERE.parent.parent


def _env(switch: bool, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "DITOPS_SGLANG"}
    env.update(extra, PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    if switch:
        env["DITOPS_SGLANG"] = "1"
    return env


def run_all(runs: dict[str, tuple[Path, Path, bool, dict[str, str], list[str]]]) -> dict:
    """Run each ``name: (checkpoint, out, switch, env, extra argv)`` through
    ``run_generator.py``, two at a time; returns each run's log; fails on a failed run."""
    logs: dict[str, str] = {}
    names = list(runs)
    for i in range(0, len(names), 2):
        procs = {}
        for j, name in enumerate(names[i : i + 2]):
            checkpoint, out, switch, extra_env, argv = runs[name]
            env = _env(switch, RUN_GENERATOR_PORT_BASE=str(31700 + 100 * (i + j)), **extra_env)
            procs[name] = subprocess.Popen(
                [sys.executable, str(HERE / "run_generator.py"), str(checkpoint), str(out), *argv],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )  # fmt: skip
        for name, proc in procs.items():
            logs[name] = proc.communicate(timeout=900)[0]
            assert proc.returncode == 0, f"{name} failed:\n{logs[name][-4000:]}"
    return logs


def bound_ops(log: str) -> set[str]:
    """The sglang op classes a run's log says ran ditops' forward."""
    marker = "ditops: sglang's "
    return {line.split(marker)[1].split()[0] for line in log.splitlines() if marker in line}


@pytest.mark.slow
def test_flux1_flux2_and_z_image_run_on_ditops_with_stock_s_frames(tmp_path: Path) -> None:
    """The image pipelines stock sglang runs on a CPU, stock and with ditops: FLUX.1's
    frames bitwise stock's; FLUX.2-klein's (its Qwen3 text encoder's rotary embedding on
    ditops) bitwise in ``exact`` precision; Z-Image's within 1% in ``fast``."""
    from tests.sglang.tiny_images import write_tiny_flux2_klein

    checkpoints = {
        "flux": write_tiny_flux(tmp_path), "zimage": write_tiny_zimage(tmp_path),
        "flux2": write_tiny_flux2_klein(tmp_path),
    }  # fmt: skip
    image = {"RUN_GENERATOR_KIND": "image"}
    runs = {
        f"{name} {mode}": (ckpt, tmp_path / f"{name}-{mode}.npy", mode == "ditops", image, [])
        for name, ckpt in checkpoints.items()
        for mode in ("stock", "ditops")
    }
    runs["flux2 ditops"] = (*runs["flux2 ditops"][:3], {**image, "DITOPS_PRECISION": "exact"}, [])
    logs = run_all(runs)
    frames = {name: np.load(run[1]) for name, run in runs.items()}
    for name, f in frames.items():
        assert f.shape == (1, 128, 128, 3) and np.isfinite(f).all(), name
    # FLUX.1's served ops are its q/k RMSNorms (ditops' torch convention, bitwise sglang's
    # in bf16 here) and a RotaryEmbedding sglang builds; Z-Image adds its adaLN norms.
    assert bound_ops(logs["flux ditops"]) == {"RMSNorm", "RotaryEmbedding"}
    assert np.array_equal(frames["flux ditops"], frames["flux stock"])
    assert {"RMSNorm", "RotaryEmbedding"} <= bound_ops(logs["flux2 ditops"])
    assert np.array_equal(frames["flux2 ditops"], frames["flux2 stock"])
    assert {"RMSNorm"} <= bound_ops(logs["zimage ditops"])
    diff = np.abs(frames["zimage ditops"] - frames["zimage stock"])
    assert diff.mean() < 0.01 * np.abs(frames["zimage stock"]).mean()
    assert not any(bound_ops(logs[f"{name} stock"]) for name in checkpoints)


SPARSE = ["block_sparse_attn", "sparsity=0.5,skip_first_steps=1,block_size=16"]


@pytest.mark.slow
def test_video_pipelines_run_sparse_on_ditops(tmp_path: Path) -> None:
    """Wan 2.1 I2V, Wan 2.2 T2V-A14B (two experts), Wan 2.2 TI2V-5B and HunyuanVideo with
    ditops' ``block_sparse_attn`` from step 1 (stock sglang stops at their first fused norm on a
    CPU): frames come out, the backend ran with its honest density (where the forced first
    frame is more than the density asked, that is said once per block-map shape, not per
    layer), and the text encoders stay dense
    without a warning per layer."""
    from PIL import Image

    from tests.sglang.tiny_video import write_tiny_hunyuan_video
    from tests.sglang.tiny_wan import write_tiny_wan

    first = tmp_path / "first.png"
    pixels = np.random.default_rng(0).integers(0, 255, (128, 128, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(first)
    checkpoints = {
        "wan2.1-i2v": write_tiny_wan(tmp_path, name="Wan2.1-I2V-14B-480P-Diffusers", i2v=True),
        "wan2.2-a14b": write_tiny_wan(tmp_path, name="Wan2.2-T2V-A14B-Diffusers", experts=2),
        "wan2.2-ti2v": write_tiny_wan(tmp_path, name="Wan2.2-TI2V-5B-Diffusers", ti2v=True),
        "hunyuanvideo": write_tiny_hunyuan_video(tmp_path),
    }
    image = {"RUN_GENERATOR_IMAGE": str(first)}
    runs = {
        name: (ckpt, tmp_path / f"{name}.npy", True, image if "i2v" in name else {}, SPARSE)
        for name, ckpt in checkpoints.items()
    }
    logs = run_all(runs)
    for name, log in logs.items():
        frames = np.load(runs[name][1])
        assert frames.ndim == 4 and frames.shape[0] >= 1 and np.isfinite(frames).all(), name
        assert "Attention backends for transformer: block_sparse_attn" in log, name
        forced = [
            line.split("forced blocks")[1] for line in log.splitlines() if "forced blocks" in line
        ]
        assert len(forced) == len(set(forced)), name  # once per block-map shape, not per layer
        assert log.count("dense SDPA runs there") <= 2, name  # one line per reason
        ops = bound_ops(log)
        assert {"RMSNorm", "LayerNormScaleShift", "MulAdd"} <= ops, (name, ops)


@pytest.mark.slow
def test_qwen_image_and_causal_wan_run_on_ditops(tmp_path: Path) -> None:
    """Qwen-Image (its rotary embedding among ditops' ops) and sglang's causal Wan
    (``LongLive2Pipeline``: causal DMD denoising, block by block with a KV cache) end to end
    with ditops' ops; stock sglang stops at the first fused norm of both on a CPU. Causal
    Wan runs dense: it cannot take ``block_sparse_attn`` (refused at start-up,
    ``test_plugin.py``)."""
    from tests.sglang.tiny_images import write_tiny_qwen_image
    from tests.sglang.tiny_wan import write_tiny_causal_wan

    runs = {
        "qwen-image": (write_tiny_qwen_image(tmp_path), tmp_path / "qwen.npy", True,
                       {"RUN_GENERATOR_KIND": "image"}, []),
        "causal wan": (write_tiny_causal_wan(tmp_path), tmp_path / "causal.npy", True, {}, []),
    }  # fmt: skip
    logs = run_all(runs)
    frames = {name: np.load(run[1]) for name, run in runs.items()}
    assert frames["qwen-image"].shape == (1, 128, 128, 3)
    # 9 frames asked, rounded up to whole blocks of 8 latent frames (29 frames) by sglang.
    assert frames["causal wan"].shape == (29, 128, 128, 3)
    assert all(np.isfinite(f).all() for f in frames.values())
    assert "LongLive2" in logs["causal wan"]
    qwen, causal = bound_ops(logs["qwen-image"]), bound_ops(logs["causal wan"])
    assert {"RMSNorm", "LayerNormScaleShift", "MulAdd", "RotaryEmbedding"} <= qwen, qwen
    assert {"FP32LayerNorm", "RMSNorm", "LayerNormScaleShift", "MulAdd"} <= causal, causal
