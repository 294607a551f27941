"""``ditops info`` stays short and says what a newcomer needs: versions, CPU features,
accelerators, the op table, one line about tuned choices (``--tuned``: each, readable)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import ditops
from ditops import cli, config, info
from ditops.core.registry import reset_state

MAX_LINES = 60


@pytest.fixture
def filled_cache(tmp_path: Path) -> Iterator[Path]:
    """Tuning on, a fresh cache folder, and many shape classes timed into it (what a
    full ``ditops tune`` of several models leaves: a hundred classes and more)."""
    reset_state()
    saved = getattr(config._local, "override", None)
    config._local.override = replace(config.get(), tune="on", cache_dir=str(tmp_path))
    try:
        with torch.inference_mode():
            # 10 widths x 2 row counts x 2 dtypes x 2 precisions, 3 ops each
            shapes = itertools.product(range(3, 13), (2, 64), (torch.float32, torch.bfloat16))
            for n, rows, dtype in shapes:
                x = torch.randn(rows, 2**n, dtype=dtype)
                for precision in ("fast", "exact"):
                    with ditops.override(precision=precision):
                        ditops.rms_norm(x, None, 1e-6)
                        ditops.gated_residual(x, x, torch.ones(2**n))
                        ditops.layer_norm_scale_shift(x, None, None, 0.5, 0.1, 1e-6)
        yield tmp_path
    finally:
        config._local.override = saved
        reset_state()


def test_info_after_many_tuned_classes_is_short(
    filled_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert len(lines) < MAX_LINES, f"ditops info printed {len(lines)} lines:\n{out}"
    classes = len(json.loads(next(filled_cache.glob("*.json")).read_text())["choices"])
    assert classes >= 100
    assert f"{classes} shape classes of 3 ops" in out
    assert "--tuned" in out and "power of two" in out
    head = "\n".join(lines[:4])
    for name in ("ditops ", "torch ", "CPU: ", "AVX2 ", "AVX-512 ", "AVX-512-BF16 ", "AMX "):
        assert name in head
    assert "accelerators: " in head and "None" not in head


def test_info_tuned_lists_each_class_with_its_dims(
    filled_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["info", "--tuned"]) == 0
    out = capsys.readouterr().out
    assert "rms_norm cpu exact float32[2,4096]" in out  # dims, not their exponents [1,12]
    assert out.count("      -> ") >= 100


def test_info_json_has_a_schema_version_and_the_detail_only_when_asked(
    filled_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["info", "--json"]) == 0
    short = json.loads(capsys.readouterr().out)
    assert short["schema_version"] == info.SCHEMA_VERSION
    assert short["versions"]["ditops"] == ditops.__version__
    assert "choices" not in short["tuning"] and "shape classes" in short["tuning"]["summary"]
    assert cli.main(["info", "--json", "--tuned"]) == 0
    assert len(json.loads(capsys.readouterr().out)["tuning"]["choices"]) >= 100


def test_accelerators_name_what_is_there_and_no_missing_runtime() -> None:
    plat = {
        "visible_devices": {"cpu": 1, "cuda": 2, "hip": 0, "npu": 0, "xpu": 0, "mps": 0},
        "cuda_runtime": "13.0",
        "hip_runtime": None,
        "cuda_devices": ["NVIDIA H200", "NVIDIA H200"],
    }
    assert info.accelerators(plat) == ["cuda: 2 x NVIDIA H200 (CUDA 13.0)"]
    plat["visible_devices"].update(cuda=0, npu=1)
    assert info.accelerators(plat) == ["npu: 1"]


def test_readable_class_turns_exponents_into_dims() -> None:
    key = "qk_norm_rope/cpu/exact/bfloat16[0,13,2,7] float32[-1,6]"
    assert info.readable_class(key) == "qk_norm_rope cpu exact bfloat16[1,8192,4,128] float32[0,64]"
