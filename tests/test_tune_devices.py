"""The tuner under the device-kind doubles and with several devices: it waits for the
call's tensors' own device, never for a device kind (ditops.core.tune_devices)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import ditops
from ditops import config
from ditops.core import tune
from ditops.core.op import CustomOp, register_op
from ditops.core.paths import NATIVE, path
from ditops.core.tune_devices import device_for_kind, sync_device
from tests.tune_helpers import tuning_on


@register_op("toy_two_kinds")
class ToyTwoKinds(CustomOp):
    """Meaning x + 1; two paths per accelerator kind, all with the meaning's bits."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1

    @path("cuda", "npu", precisions=("exact", "fast"), fast_bits="native")
    def forward_accel_a(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1

    @path("cuda", "npu", precisions=("exact", "fast"), fast_bits="native")
    def forward_accel_b(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


@pytest.fixture(autouse=True)
def _tuning_on(tmp_path: Path) -> Iterator[Path]:
    with tuning_on(tmp_path) as where:
        yield where


@pytest.mark.parametrize("kind", ["cuda", "npu"])
def test_tuning_under_the_device_kind_doubles_times_without_touching_an_accelerator(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_accelerator(*args: object) -> None:
        raise AssertionError("the tuner touched an accelerator for CPU tensors")

    monkeypatch.setattr(torch.accelerator, "synchronize", no_accelerator)
    monkeypatch.setattr(torch.cuda, "synchronize", no_accelerator)
    x = torch.randn(4, 8)
    with ditops.force_device_kind({"cpu": kind}):
        out = ToyTwoKinds()(x)
        key = tune.class_key("toy_two_kinds", kind, config.get().precision, [x])
        assert tune.choices()[key].candidates == ("forward_accel_a", "forward_accel_b", NATIVE)
    assert torch.equal(out, x + 1)


def test_real_ops_tune_on_under_the_cuda_doubles() -> None:
    """Ops whose Triton paths run through the interpreter for CPU tensors dispatched as
    CUDA: tuning on, every call completes with the static path's bits."""
    pytest.importorskip("triton")
    x, w, b = torch.randn(2, 8, 64), torch.randn(64), torch.randn(64)
    with ditops.force_device_kind({"cpu": "cuda"}):
        with config.override(tune="off"):
            want = ditops.fp32_layer_norm(x, (64,), w, b)
        for _ in range(2):
            assert torch.equal(ditops.fp32_layer_norm(x, (64,), w, b), want)


def test_the_tensors_device_is_waited_for_not_the_current_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    waited: list[object] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    sync_device(torch.device("cuda", 1))
    sync_device(torch.device("cpu"))
    sync_device(torch.device("meta"))
    assert waited == [torch.device("cuda", 1)]


def test_a_kind_without_its_accelerator_names_no_device() -> None:
    if torch.accelerator.is_available():
        pytest.skip("this machine has an accelerator")  # the CI and dev hosts have none
    assert device_for_kind("cuda") is None and device_for_kind("cpu") is None
