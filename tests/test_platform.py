"""Device kinds, visible devices, and that importing ditops imports nothing optional."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import ditops
from ditops.platform import device_kind, force_device_kind, visible_devices


def test_cpu_kind() -> None:
    assert device_kind(torch.zeros(1)) == "cpu"
    assert device_kind("cpu") == "cpu"
    assert device_kind(torch.device("cpu")) == "cpu"


def test_cuda_and_hip(monkeypatch: pytest.MonkeyPatch) -> None:
    assert device_kind(torch.device("cuda", 0)) == "cuda"
    # A ROCm build reports its GPUs as device type cuda; ditops calls them hip.
    monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)
    assert device_kind(torch.device("cuda", 0)) == "hip"


def test_other_kinds() -> None:
    assert device_kind("xpu") == "xpu"
    assert device_kind("mps") == "mps"
    assert device_kind("meta") == "meta"


def test_bad_argument() -> None:
    with pytest.raises(TypeError, match="tensor, torch.device or str"):
        device_kind(3)  # type: ignore[arg-type]


def test_force_device_kind_is_scoped_and_validated() -> None:
    with force_device_kind({"cpu": "npu"}):
        assert device_kind(torch.zeros(1)) == "npu"
        with force_device_kind({"cpu": "cuda"}):
            assert device_kind(torch.zeros(1)) == "cuda"
        assert device_kind(torch.zeros(1)) == "npu"
    assert device_kind(torch.zeros(1)) == "cpu"
    with pytest.raises(ValueError, match="unknown device kind"):
        with force_device_kind({"cpu": "tpu"}):
            pass


def test_visible_devices_here() -> None:
    seen = visible_devices()
    assert seen["cpu"] == 1
    assert seen["cuda"] == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert set(seen) == {"cpu", "cuda", "hip", "npu", "xpu", "mps"}
    assert ditops.visible_devices() == seen


def test_import_ditops_imports_no_optional_package() -> None:
    code = (
        "import sys, ditops\n"
        "bad = [m for m in ('triton', 'diffusers', 'torch_npu', 'attentions', 'sgl_kernel_npu',"
        " 'matplotlib')"
        " if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
