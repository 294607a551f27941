"""The qk_norm_rope benchmark suite on tiny shapes: every variant computes the same
thing, the CLI prints the target summary, and the summary checks the targets."""

from __future__ import annotations

import json

import pytest
import torch

from ditops import cli
from ditops.bench import qk_norm_rope as bench
from tests.precision import assert_exact, assert_fast_pairs


@pytest.fixture
def tiny(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "HEAD_DIM", 16)
    monkeypatch.setattr(bench, "SHAPES", {"small": (("wan", 12, 3, True), ("flux", 10, 2, False))})


def test_variants_agree(tiny: None) -> None:
    # the eager meaning stands in for its compiled form (compiling is the CLI test's job)
    case = bench._case("wan", 12, 3, True, torch.device("cpu"), bench._meaning)
    out = {name: case.variants[name]() for name in ("native", "compile", "exact", "fast")}
    for i in range(2):
        assert_exact(out["exact"][i], out["native"][i])
        assert_exact(out["compile"][i], out["native"][i])
        assert_fast_pairs(out["fast"][i], out["native"][i], "interleaved", slack=10)
    assert case.bytes_moved == 4 * out["native"][0].numel() * 2


@pytest.mark.slow  # compiles the meaning once per shape
def test_cli_runs_the_suite(
    tiny: None, monkeypatch: pytest.MonkeyPatch, tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(bench.SHAPES, "small", (("flux", 10, 2, False),))
    path = tmp_path / "qk.json"
    argv = ["bench", "qk_norm_rope", "--json", str(path), "--no-progress", "--min-seconds", "1e-9"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "qk_norm_rope targets" in out and "flux 10x2x16" in out
    payload = json.loads(path.read_text())
    variants = {r["variant"] for r in payload["rows"] if r["suite"] == "qk_norm_rope"}
    assert variants == set(bench.VARIANTS)
    assert not [r for r in payload["rows"] if r["error"]]
    assert [s["case"] for s in payload["qk_norm_rope_summary"]] == ["flux 10x2x16"]


def test_summary_checks_the_targets() -> None:
    def row(variant: str, native: float, compile_: float, clone: float | None) -> dict:
        return {
            "suite": "qk_norm_rope",
            "case": "wan",
            "variant": variant,
            "vs_native": native,
            "vs_compile": compile_,
            "of_clone_bw": clone,
        }

    rows = [row("exact", 3.5, 0.4, 0.1), row("fast", 9.0, 1.2, 0.6)]
    (s,) = bench.summary(rows)
    assert s["targets_met"] == {
        "exact >= 3x native": True,
        "fast >= 1.0x compile": True,
        "fast >= 0.7 of clone": False,
    }


def test_interleaved_timing(tiny: None) -> None:
    """Each variant once per round; ratios are medians of the per-round ratios."""
    case = bench._case("flux", 10, 2, False, torch.device("cpu"), bench._meaning)
    results = bench.interleaved(case, 3, torch.device("cpu"))
    assert [r.variant for r in results] == list(bench.VARIANTS)
    assert all(r.reps == 3 and r.median_s > 0 for r in results)
    rows = {r["variant"]: r for r in bench.interleaved_rows(results)}
    assert rows["native"]["vs_native"] == 1.0 and rows["clone"]["of_clone_bw"] == 1.0
    assert rows["fast"]["vs_compile"] > 0 and "p_ratio_to" not in rows["fast"]
