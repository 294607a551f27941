"""A sweep of the tuner's states, caches, devices and CLI (issue 35's spirit): whatever
the cache holds or the timing says, a run goes on and its bits are the static choice's."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ditops import cli, config
from ditops.core import tune, tune_store
from ditops.core.registry import registered_ops, reset_state
from tests.test_tune_bits import _bits, _sample
from tests.test_tune_cache import RAN, toy
from tests.tune_helpers import tuning_on


@pytest.fixture(autouse=True)
def _tuning(tmp_path: Path) -> Iterator[Path]:
    RAN.clear()
    with tuning_on(tmp_path) as where:
        yield where


def _ok(x: torch.Tensor) -> None:
    assert torch.equal(toy(x), x * 3)


@pytest.mark.parametrize(
    "content",
    [
        b"\xff\xfe\x00not utf-8",
        b"[1, 2]",
        b'{"choices": {"toy_cached/cpu/fast/x": "a string"}, "format": 2}',
        b'{"choices": [], "format": 2}',
        b'{"choices": {}, "format": true}',
        b'{"choices": {"k": {"winner": 1, "candidates": 5, "times_ms": {"a": "x"}}}, "format": 2}',
        b"",
    ],
    ids=["binary", "list", "string-record", "list-choices", "bool-format", "bad-types", "empty"],
)
def test_any_file_content_leaves_the_run_going(content: bytes, ditops_warnings) -> None:
    path = tune.cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    _ok(torch.ones(4))
    _ok(torch.ones(4))
    assert len(ditops_warnings()) <= 1


def test_a_cache_file_that_is_a_folder_warns_once_and_runs(ditops_warnings) -> None:
    tune.cache_file().mkdir(parents=True)
    _ok(torch.ones(4))
    _ok(torch.ones(16, 16))
    assert len(ditops_warnings()) == 1 and tune.cache_file().is_dir()


def test_a_cache_dir_that_is_a_file_warns_once_and_runs(tmp_path: Path, ditops_warnings) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    config._local.override = config.replace(config.get(), cache_dir=str(blocker / "sub"))
    _ok(torch.ones(4))
    _ok(torch.ones(16, 16))
    assert len(ditops_warnings()) == 1 and blocker.read_text() == "x"


def test_an_unknown_load_never_times_again() -> None:
    old = tune.Choice("forward_cpu", ("forward_cpu", "forward_native"), {}, -1.0, "cache")
    assert not tune_store.timed_under_heavier_load(old, now=0.0)
    heavy = tune.Choice("forward_cpu", ("forward_cpu", "forward_native"), {}, 3.0, "cache")
    assert tune_store.timed_under_heavier_load(heavy, now=0.5)
    assert not tune_store.timed_under_heavier_load(heavy, now=-1.0)  # now unknown


def test_clear_with_an_unusable_cache_folder_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    config._local.override = config.replace(config.get(), cache_dir="~nosuchuser-ditops/x")
    assert cli.main(["tune", "--clear"]) == 0
    assert "nothing removed" in capsys.readouterr().out


@pytest.mark.parametrize("device", ["cuda:0", " ", "npu", "cpu:x"])
@pytest.mark.parametrize("command", ["tune", "bench"])
def test_more_devices_are_refused_in_one_line(
    command: str, device: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if device.startswith("cuda") and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert cli.main([command, "--device", device]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"ditops {command}: --device") and "\n" not in err


@pytest.mark.parametrize("precision", ["fast", "exact"])
@pytest.mark.parametrize(
    "name", [n for n in registered_ops() if not n.startswith("toy") and n != "gelu_tanh_bias"]
)
def test_under_any_load_the_first_and_later_calls_are_the_static_bits(
    name: str, precision: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A clock that jumps (any load, any neighbour) picks arbitrary winners: every call
    still returns what DITOPS_TUNE=off gives."""
    op, args, kwargs = _sample(name)
    op.precision = precision  # type: ignore[attr-defined]
    with torch.no_grad():
        with config.override(tune="off"):
            static = _bits(op(*args, **kwargs))
        for seed in range(4):  # several runs without a cache file, each its own "load"
            reset_state()
            tune.cache_file().unlink(missing_ok=True)  # a run that finds no cache file
            rng = random.Random(seed)
            clock = itertools.accumulate(rng.uniform(0, 1) for _ in range(10**6))
            monkeypatch.setattr(tune.time, "perf_counter", lambda c=clock: next(c))
            for _ in range(3):
                got = _bits(op(*args, **kwargs))
                assert all(torch.equal(a, b) for a, b in zip(got, static, strict=True)), seed
