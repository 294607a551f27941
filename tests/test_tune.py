"""DITOPS_TUNE: paths chosen by measurement (ditops.core.tune).

A toy op whose paths sleep for set times stands in for kernels of known speed, so the
tests know which one must win without timing anything real.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ditops import config
from ditops.core import tune
from ditops.core.op import CustomOp, register_op
from ditops.core.paths import path
from tests.tune_helpers import tuning_on

#: seconds each competitor sleeps (a test sets them)
DELAY = {"native": 0.0, "forward_cpu": 0.0, "forward_cpu_b": 0.0}
RAN: list[str] = []
FAIL: set[str] = set()
FAIL_AT: dict[str, tuple[int, ...]] = {}  # name -> its calls (1-based) that raise
SLOW_FIRST: dict[str, tuple[float, ...]] = {}  # name -> the sleeps of its first calls
#: the tuner's threshold for timing more rounds; the tests that count calls set it out of
#: reach (a sleep overshooting on a loaded machine would add a round), those of the
#: extra rounds put it back
SETTLE_MIN_S = tune.SETTLE_MIN_S


def _run(name: str, x: torch.Tensor) -> torch.Tensor:
    RAN.append(name)
    if name in FAIL or RAN.count(name) in FAIL_AT.get(name, ()):
        raise RuntimeError(f"{name} exploded")
    first = SLOW_FIRST.get(name, ())
    n = RAN.count(name)
    time.sleep(first[n - 1] if n <= len(first) else DELAY[name])
    return x * 2


@register_op("toy_tuned")
class ToyTuned(CustomOp):
    """Meaning: 2 * x; both paths give the very same bits."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return _run("native", x)

    @path(precisions=("exact", "fast"), fast_bits="native")
    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        return _run("forward_cpu", x)

    @path("cpu", precisions=("exact", "fast"), inference_only=True, fast_bits="native")
    def forward_cpu_b(self, x: torch.Tensor) -> torch.Tensor:
        return _run("forward_cpu_b", x)


@register_op("toy_oracle")
class ToyOracle(CustomOp):
    """One path and a meaning that does not compete: nothing to time."""

    meaning_competes = False

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return _run("native", x)

    @path(precisions=("exact", "fast"))
    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        return _run("forward_cpu", x)


toy = ToyTuned()


@pytest.fixture(autouse=True)
def _clean(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Tuning on, the cache in a fresh folder (this thread's settings, as override())."""
    DELAY.update(native=0.0, forward_cpu=0.0, forward_cpu_b=0.0)
    RAN.clear()
    FAIL.clear()
    FAIL_AT.clear()
    SLOW_FIRST.clear()
    monkeypatch.setattr(tune, "SETTLE_MIN_S", 1e9)
    with tuning_on(tmp_path) as where:
        yield where


def test_bad_tune_value_raises_with_the_allowed_ones() -> None:
    with pytest.raises(config.ConfigError, match="off, on, cache"):
        config.from_env({"DITOPS_TUNE": "fastest"})
    before = config.get()
    with pytest.raises(config.ConfigError, match="off, on, cache"):
        config.configure(tune="always")
    assert config.get() == before
    assert config.from_env({}).tune == "on"


def test_the_fastest_competitor_wins_and_is_remembered(_clean: Path) -> None:
    DELAY.update(native=0.05, forward_cpu=0.05, forward_cpu_b=0.0)
    x = torch.ones(3, 5)
    out = toy(x)
    assert torch.equal(out, x * 2)
    # the static choice ran first (its output is the result), then each other warmed up,
    # then two rounds of all three
    assert RAN[0] == "forward_cpu"
    assert sorted(RAN) == sorted(["forward_cpu"] * 3 + ["forward_cpu_b"] * 3 + ["native"] * 3)
    RAN.clear()
    toy(torch.zeros(3, 4))  # the same class: 3, 4 and 5 round to 2**2
    assert RAN == ["forward_cpu_b"]
    (key, choice), *_ = tune.choices().items()
    assert key == "toy_tuned/cpu/fast/float32[2,2]"
    assert choice.winner == "forward_cpu_b"
    assert choice.candidates == ("forward_cpu", "forward_cpu_b", "forward_native")
    data = json.loads(tune.cache_file().read_text())
    assert data["fingerprint"] == tune.fingerprint()
    assert data["choices"][key]["winner"] == "forward_cpu_b"
    assert tune.cache_file().parent == _clean


def test_another_class_is_timed_again() -> None:
    toy(torch.ones(3, 5))
    RAN.clear()
    toy(torch.ones(3, 64))
    assert len(RAN) == 9
    assert len(tune.choices()) == 2


def test_the_meaning_wins_where_the_paths_lose() -> None:
    DELAY.update(native=0.0, forward_cpu=0.05, forward_cpu_b=0.05)
    toy(torch.ones(4))
    RAN.clear()
    toy(torch.ones(4))
    assert RAN == ["native"]


def test_timing_goes_on_while_a_competitor_is_still_warming_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tune, "SETTLE_MIN_S", SETTLE_MIN_S)
    # The meaning's first calls are slow and get faster (as fresh pages make a big op's
    # first calls), then it is the fastest: two timed rounds would have kept forward_cpu.
    DELAY.update(native=0.0, forward_cpu=0.02, forward_cpu_b=0.02)
    SLOW_FIRST["native"] = (0.1, 0.08, 0.06, 0.04)
    toy(torch.ones(4))
    choice = next(iter(tune.choices().values()))
    assert choice.winner == "forward_native"
    assert 5 <= RAN.count("native") <= 1 + tune.MAX_ROUNDS
    RAN.clear()
    toy(torch.ones(4))
    assert RAN == ["native"]


def test_timing_stops_early_when_nothing_moves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tune, "SETTLE_MIN_S", SETTLE_MIN_S)
    DELAY.update(native=0.02, forward_cpu=0.0, forward_cpu_b=0.02)
    toy(torch.ones(4))
    # two rounds, one more now and then where a sleep overshot on a loaded machine
    assert 1 + tune.ROUNDS <= RAN.count("native") < 1 + tune.MAX_ROUNDS


def test_the_static_choice_stays_unless_clearly_beaten() -> None:
    toy(torch.ones(4))  # all equally fast (no delay): noise must not move the choice
    RAN.clear()
    choice = next(iter(tune.choices().values()))
    if choice.winner != "forward_cpu":  # only when another was KEEP_MARGIN faster
        assert (
            choice.times_ms[choice.winner] * (1 + tune.KEEP_MARGIN) < choice.times_ms["forward_cpu"]
        )


def test_cache_mode_reads_the_file_and_times_nothing() -> None:
    DELAY.update(forward_cpu=0.05, native=0.05)
    toy(torch.ones(4))
    tune.forget()  # a new process: only the file remains
    RAN.clear()
    with config.override(tune="cache"):
        toy(torch.ones(4))
        assert RAN == ["forward_cpu_b"]
        RAN.clear()
        toy(torch.ones(100))  # no record: the static choice, nothing timed
        assert RAN == ["forward_cpu"]
    assert next(iter(tune.choices().values())).source == "cache"


def test_off_is_the_static_order_and_writes_nothing() -> None:
    DELAY.update(forward_cpu=0.05)
    with config.override(tune="off"):
        toy(torch.ones(4))
        toy(torch.ones(4))
    assert RAN == ["forward_cpu", "forward_cpu"]
    assert not tune.cache_file().exists()
    assert tune.choices() == {}


def test_exact_precision_is_a_class_of_its_own() -> None:
    toy(torch.ones(4))
    with config.override(precision="exact"):
        toy(torch.ones(4))
    assert {k.split("/")[2] for k in tune.choices()} == {"fast", "exact"}


def test_a_winner_that_raises_later_falls_back(ditops_warnings) -> None:
    DELAY.update(forward_cpu=0.05, native=0.05)
    toy(torch.ones(4))
    FAIL.add("forward_cpu_b")
    RAN.clear()
    assert torch.equal(toy(torch.ones(4)), torch.full((4,), 2.0))
    assert RAN == ["forward_cpu_b", "native"]  # the meaning served the call
    assert any("forward_cpu_b raised" in m for m in ditops_warnings())
    RAN.clear()
    toy(torch.ones(4))  # its record names a broken path: timed again without it
    assert "forward_cpu_b" not in RAN


def test_a_competitor_raising_while_timed_is_left_out() -> None:
    FAIL.add("forward_cpu_b")
    assert torch.equal(toy(torch.ones(4)), torch.full((4,), 2.0))
    choice = next(iter(tune.choices().values()))
    assert "forward_cpu_b" not in choice.times_ms
    assert choice.winner in ("forward_cpu", "forward_native")


def test_a_competitor_raising_in_a_timed_round_loses_and_the_call_goes_on() -> None:
    FAIL_AT["forward_cpu_b"] = (2,)  # its warm-up passes, its first timed run raises
    assert torch.equal(toy(torch.ones(4)), torch.full((4,), 2.0))
    choice = next(iter(tune.choices().values()))
    assert choice.winner != "forward_cpu_b"


def test_one_competitor_is_never_timed() -> None:
    ToyOracle()(torch.ones(4))
    assert RAN == ["forward_cpu"]
    assert tune.choices() == {}


def test_a_call_not_every_competitor_takes_is_not_timed() -> None:
    x = torch.ones(4, requires_grad=True)  # forward_cpu_b has no backward
    with torch.enable_grad():
        toy(x)
    assert RAN == ["forward_cpu"]
    assert tune.choices() == {}
    RAN.clear()
    toy(torch.ones(4))  # the next call all can take is timed
    assert len(RAN) == 9


def test_a_corrupt_cache_is_warned_about_and_ignored(ditops_warnings) -> None:
    path = tune.cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{not json")
    assert torch.equal(toy(torch.ones(4)), torch.full((4,), 2.0))
    assert any("cannot read" in m for m in ditops_warnings())


def test_threads_time_a_class_once_and_get_right_results() -> None:
    DELAY.update(forward_cpu=0.01, forward_cpu_b=0.0, native=0.01)  # any winner: one timing
    outs: list[bool] = []
    barrier = threading.Barrier(4)
    cfg = config.get()

    def work(seed: int) -> None:
        config._local.override = cfg  # the test's settings in this thread too
        barrier.wait()
        for _ in range(5):
            x = torch.full((4,), float(seed))
            outs.append(torch.equal(toy(x), x * 2))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outs == [True] * 20
    # one timing (9 runs) plus 19 plain calls
    assert len(RAN) == 9 + 19
    assert len(tune.choices()) == 1


def test_traced_calls_keep_the_static_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_timing(*args: object) -> object:
        raise AssertionError("timed inside torch.compile")

    monkeypatch.setattr(tune, "dispatch", no_timing)
    fn = torch.compile(lambda x: toy(x) + 1, backend="eager", fullgraph=False)
    out = fn(torch.ones(4))
    assert torch.equal(out, torch.full((4,), 3.0))


def test_ditops_tune_on_a_tiny_wan_then_info_shows_the_choices(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], _clean: Path
) -> None:
    """`ditops tune` times the bench Wan's classes (a tiny one here); `ditops info` lists
    them with their times. Exact precision: every competitor is bitwise equal, so the
    tuned model's output is the untuned one's."""
    pytest.importorskip("diffusers")
    from ditops import cli
    from ditops.bench import wan, wan_model
    from tests.bench.test_masks_bench import TINY_WAN

    tiny = {**wan_model.DEFAULT_CONFIG, **TINY_WAN}
    monkeypatch.setattr(wan_model, "DEFAULT_CONFIG", tiny)
    monkeypatch.setattr(wan, "LATENTS", {"small": (1, 4, 2, 16, 16)})
    monkeypatch.setattr(wan, "TEXT_TOKENS", 8)
    monkeypatch.setenv("DITOPS_CACHE_DIR", str(_clean))
    assert cli.main(["tune", "--precision", "exact", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "layer_norm_scale_shift cpu exact float32" in out and " ms" in out
    keys = set(json.loads(tune.cache_file().read_text())["choices"])
    assert any(k.startswith("gated_residual/cpu/exact/") for k in keys)
    assert cli.main(["info", "--tuned"]) == 0
    out = capsys.readouterr().out
    assert "DITOPS_TUNE=on" in out and "layer_norm_scale_shift cpu exact" in out


def test_launch_configs_compete_only_when_they_give_the_same_bits() -> None:
    """The Triton LayerNorm's configs may change a row's reduction order: it runs its
    static config, bitwise what ``off`` gives, and nothing is timed. Configs a kernel
    declares ``same_bits`` are timed, recorded under their shape class and reused."""
    pytest.importorskip("triton")
    from ditops import launch
    from ditops.kernels.triton import layer_norm as tln

    x = torch.randn(64, 96)
    w, b = torch.randn(96), torch.randn(96)
    with config.override(tune="off"):
        want = tln.fp32_layer_norm(x, w, b, 1e-6)
    assert torch.equal(tln.fp32_layer_norm(x, w, b, 1e-6), want)
    assert not [k for k in tune.choices() if "config" in k]
    ran: list[int] = []
    configs = [{"n": 0}, {"n": 1}]
    launch.launch("toy_kernel", "cpu", (64, 96), configs, lambda c: ran.append(c["n"]), True)
    (key, choice), *_ = [(k, c) for k, c in tune.choices().items() if "config" in k]
    assert key.startswith("toy_kernel/cpu/config/") and ran[-1] == 0  # the static one last
    assert set(choice.times_ms) == set(choice.candidates) and len(choice.candidates) == 2
    ran.clear()
    with config.override(tune="cache"):  # recorded: no timing needed
        launch.launch("toy_kernel", "cpu", (64, 96), configs, lambda c: ran.append(c["n"]), True)
    assert len(ran) == 1 and tune.choices()[key] is choice


def test_explain_call_names_the_tuned_winner_and_why() -> None:
    DELAY.update(forward_cpu=0.05, native=0.05)
    x = torch.ones(4)
    assert toy.explain_call(x).chosen == "forward_cpu"  # nothing measured yet
    toy(x)
    decision = toy.explain_call(x)
    assert decision.chosen == "forward_cpu_b"
    assert "forward_cpu_b" not in decision.tuned and "cpu_b " in decision.tuned
    with config.override(tune="off"):
        assert toy.explain_call(x).chosen == "forward_cpu"
