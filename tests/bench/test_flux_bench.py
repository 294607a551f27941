"""``ditops bench flux``: the suite on a tiny FLUX config, and its place in the command."""

from __future__ import annotations

import json

import pytest
import torch

from ditops import cli
from ditops.bench import flux

pytest.importorskip("diffusers", reason="the diffusers extra is part of the test install")

TINY = dict(
    attention_head_dim=16,
    axes_dims_rope=(4, 6, 6),
    num_attention_heads=2,
    in_channels=8,
    joint_attention_dim=16,
    pooled_projection_dim=8,
)


def test_run_reports_every_variant_with_its_drift() -> None:
    result = flux.run(
        torch.device("cpu"), "small", rounds=2, image_side=4, text_tokens=3, progress=False, **TINY
    )
    rows = {s["variant"]: s for s in result["summary"]}
    assert list(rows) == ["unpatched", "exact", "fast"]
    assert rows["unpatched"]["speedup"] == 1.0 and rows["unpatched"]["bitwise_equal"]
    assert rows["exact"]["bitwise_equal"] and rows["exact"]["max_abs"] == 0.0
    assert 0 < rows["fast"]["max_rel"] < 2e-2  # bf16: fast rounds once, some bits differ
    assert all(len(v) == 2 for v in result["seconds"].values())
    assert all(s["median_seconds"] > s["median_attention_seconds"] > 0 for s in rows.values())
    assert result["image_tokens"] == 16 and result["config"]["num_attention_heads"] == 2
    json.dumps(result)  # the CLI writes it as JSON


def test_bad_size_is_refused() -> None:
    with pytest.raises(ValueError, match="size must be one of"):
        flux.run(torch.device("cpu"), "huge")


def test_cli_runs_the_flux_suite(monkeypatch: pytest.MonkeyPatch, tmp_path, capsys) -> None:
    tiny = {
        "config": {**flux.SIZES["small"]["config"], **TINY},
        "image_side": 3,
        "text_tokens": 2,
        "rounds": 1,
    }
    monkeypatch.setitem(flux.SIZES, "small", tiny)
    path = tmp_path / "flux.json"
    assert cli.main(["bench", "flux", "--no-progress", "--json", str(path)]) == 0
    assert "== flux (small): 9 image + 2 text tokens" in capsys.readouterr().out
    payload = json.loads(path.read_text())
    assert [s["variant"] for s in payload["flux"]["summary"]] == ["unpatched", "exact", "fast"]
    assert payload["flux"]["dtype"] == "bfloat16"  # --dtype auto: FLUX's own
    # --dtype is honoured (it was ignored by this suite before the model benches shared a runner)
    assert (
        cli.main(["bench", "flux", "--no-progress", "--dtype", "float32", "--json", str(path)]) == 0
    )
    assert json.loads(path.read_text())["flux"]["dtype"] == "float32"
