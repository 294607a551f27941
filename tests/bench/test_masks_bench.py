"""``ditops bench masks`` at a tiny size: the table, the plot, the JSON."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from ditops import cli
from ditops.attention.methods import METHODS
from ditops.bench import masks
from ditops.bench.harness import ratios, run_cases

TINY = {"keeps": (0.6,), "heads": 2, "dim": 24, "block_size": 32, "stride": 4, "samples": 2}


def tiny_cases(device: torch.device, size: str, dtype: torch.dtype = torch.float32):
    return masks.cases_for([(8, 4, 8)], device, dtype=torch.float32, **TINY)  # 8 blocks


def test_summary_has_every_method_against_both_oracles(tmp_path) -> None:
    results = list(run_cases(tiny_cases(torch.device("cpu"), "small"), torch.device("cpu"),
                             n_steps=1, desc="masks", progress=False, min_seconds=0.0))  # fmt: skip
    summ = masks.summary(ratios(results))
    assert [s["method"] for s in summ] == list(METHODS)
    for s in summ:
        assert abs(s["density"] - 0.6) <= 1 / 64  # the density asked for runs
        assert 0 < s["mass_vs_row"] <= 1 + 1e-6 and 0 < s["mass_vs_head"] <= 1 + 1e-6
        assert s["mass_vs_head"] <= s["mass_vs_row"] + 1e-6  # the per-head oracle keeps more
        assert s["rel_err"] > 0 and s["err_vs_row_oracle"] > 0
        assert s["estimate_share"] > 0 and s["attention_speedup"] > 0
    masks.print_summary(summ)
    masks.plot(summ, str(tmp_path / "m.png"))
    assert (tmp_path / "m.png").stat().st_size > 1000


def test_cli_runs_the_suite(monkeypatch: pytest.MonkeyPatch, tmp_path, capsys) -> None:
    tiny = dataclasses.replace(masks.SUITE, cases=tiny_cases, steps=lambda size: 9)
    monkeypatch.setattr(masks, "SUITE", tiny)
    png, out = tmp_path / "masks.png", tmp_path / "masks.json"
    argv = ["bench", "masks", "--no-progress", "--min-seconds", "0", "--device", "cpu"]
    assert cli.main([*argv, "--plot", str(png), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "/row or" in text and "sampled_head" in text
    assert png.stat().st_size > 1000
    payload = json.loads(out.read_text())
    assert {s["method"] for s in payload["masks_summary"]} == set(METHODS)
