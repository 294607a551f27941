"""The tuner's cache file: a bad one never breaks a run, its warning is true, it has a
format version, it remembers the load a choice was timed under, old files are pruned
(ditops.core.tune, ditops.core.tune_store)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ditops import cli, config
from ditops.core import tune, tune_store
from ditops.core.op import CustomOp, register_op
from ditops.core.paths import path
from ditops.core.registry import reset_state
from tests.tune_helpers import tuning_on

RAN: list[str] = []


@register_op("toy_cached")
class ToyCached(CustomOp):
    """Meaning x * 3; one path with the same bits: two competitors."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        RAN.append("native")
        return x * 3

    @path(precisions=("exact", "fast"), fast_bits="native")
    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        RAN.append("forward_cpu")
        return x * 3


toy = ToyCached()


@pytest.fixture(autouse=True)
def _tuning_on(tmp_path: Path) -> Iterator[Path]:
    RAN.clear()
    with tuning_on(tmp_path) as where:
        yield where


def _runs(x: torch.Tensor) -> None:
    assert torch.equal(toy(x), x * 3)


def test_an_unknown_users_home_warns_and_keeps_choices_in_memory(
    ditops_warnings, capsys: pytest.CaptureFixture[str]
) -> None:
    config._local.override = replace(config.get(), cache_dir="~nosuchuser-ditops/x")
    _runs(torch.ones(4))
    _runs(torch.ones(4))
    assert RAN.count("native") > 0  # timed, in memory
    assert len([m for m in ditops_warnings() if "nosuchuser" in m]) == 1
    assert cli.main(["info"]) == 0  # ditops info reads this thread's settings
    assert "nosuchuser" in capsys.readouterr().out
    assert cli.main(["info", "--json"]) == 0
    assert "nosuchuser" in json.loads(capsys.readouterr().out)["tuning"]["cache_file"]
    from ditops.bench.load import header

    assert "in memory only" in header()[-1]  # ditops bench and tune open with it


def test_deeply_nested_json_is_warned_about_and_ignored(ditops_warnings) -> None:
    path = tune.cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("[" * 100_000 + "]" * 100_000)
    _runs(torch.ones(4))
    assert any("cannot read" in m for m in ditops_warnings())


def test_a_corrupt_file_said_to_be_kept_in_memory_only_is_not_overwritten(
    ditops_warnings,
) -> None:
    path = tune.cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{not json")
    _runs(torch.ones(4))
    _runs(torch.ones(8, 8))  # another class timed: a save would happen
    (warning,) = ditops_warnings()
    assert "in memory only" in warning and path.read_text() == "{not json"


def test_the_file_has_a_format_version_and_other_formats_are_ignored_in_one_line(
    ditops_warnings,
) -> None:
    _runs(torch.ones(4))
    path = tune.cache_file()
    data = json.loads(path.read_text())
    assert data["format"] == tune_store.FORMAT
    for n, other in enumerate((tune_store.FORMAT - 1, tune_store.FORMAT + 1, None), 1):
        reset_state()
        RAN.clear()
        body = {**data, "format": other} if other is not None else {"choices": data["choices"]}
        path.write_text(json.dumps(body))
        _runs(torch.ones(4))
        assert "native" in RAN  # its choice was not used: timed again
        assert sum("format" in m for m in ditops_warnings()) == n  # one line each
        if other is not None and other > tune_store.FORMAT:  # a newer ditops's: left alone
            assert json.loads(path.read_text())["format"] == other


def test_a_choice_timed_under_much_heavier_load_is_timed_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tune_store, "load_per_core", lambda: 4.0)
    _runs(torch.ones(4))
    record = json.loads(tune.cache_file().read_text())["choices"]
    assert [r["load_per_core"] for r in record.values()] == [4.0]
    for now, timed_again in ((3.5, False), (0.1, True)):
        reset_state()
        RAN.clear()
        monkeypatch.setattr(tune_store, "load_per_core", lambda now=now: now)
        _runs(torch.ones(4))
        assert ("native" in RAN and "forward_cpu" in RAN) is timed_again, now
    record = json.loads(tune.cache_file().read_text())["choices"]
    assert [r["load_per_core"] for r in record.values()] == [0.1]


def test_old_files_of_this_machine_are_pruned_others_kept(tmp_path: Path) -> None:
    mine = tune.fingerprint()
    older = tmp_path / "tune-0123456789abcdef.json"
    older.write_text(json.dumps({"fingerprint": {**mine, "ditops": "0.0.1"}, "choices": {}}))
    other_machine = tmp_path / "tune-fedcba9876543210.json"
    other_machine.write_text(json.dumps({"fingerprint": {**mine, "cpu": "another"}}))
    stale_tmp = tmp_path / "tune-x.json.123.456.tmp"
    stale_tmp.write_text("{")
    os.utime(stale_tmp, (time.time() - 7200, time.time() - 7200))
    _runs(torch.ones(4))
    assert not older.exists() and not stale_tmp.exists()
    assert other_machine.exists() and tune.cache_file().exists()


def test_ditops_tune_clear_removes_this_machines_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _runs(torch.ones(4))
    assert tune.cache_file().exists()
    monkeypatch.setenv("DITOPS_CACHE_DIR", str(tmp_path))
    assert cli.main(["tune", "--clear"]) == 0
    assert not tune.cache_file().exists() and tune.choices() == {}
    assert str(tune.cache_file()) in capsys.readouterr().out
    assert cli.main(["tune", "--clear"]) == 0  # nothing to clear: said, not an error
    assert "nothing" in capsys.readouterr().out


def test_force_times_recorded_classes_again() -> None:
    _runs(torch.ones(4))
    reset_state()
    RAN.clear()
    with tune.retiming():
        _runs(torch.ones(4))
    assert "native" in RAN and "forward_cpu" in RAN
    (choice,) = tune.choices().values()
    assert choice.source == "measured"


@pytest.mark.parametrize("device", ["bogus", "cuda", "meta", ""])
def test_ditops_tune_refuses_a_device_it_cannot_time_on_in_one_line(
    device: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert cli.main(["tune", "--device", device]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ditops tune: --device") and "\n" not in err


def test_every_tune_option_has_help_text() -> None:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    tune_parser = sub.choices["tune"]  # type: ignore[attr-defined]
    for action in tune_parser._actions:
        assert action.help, action.dest
