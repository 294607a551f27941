"""``ditops bench ltx_video`` and ``video_scaling --family ltx_video`` on a tiny config."""

from __future__ import annotations

import json

import pytest
import torch

from ditops import cli
from ditops.bench import ltx_video, video_scaling

pytest.importorskip("diffusers", reason="the diffusers extra is part of the test install")

TINY = dict(
    in_channels=8,
    out_channels=8,
    num_attention_heads=2,
    attention_head_dim=16,
    cross_attention_dim=32,
    caption_channels=16,
    num_layers=1,
)
# 8 frames of 4 x 4 tokens (128 video tokens), 8 text (2 padded): blocks of 8
SMALL = dict(latent=(8, 4, 4), text_tokens=8, block_size=8)


def test_run_reports_every_variant_with_density_and_drift() -> None:
    result = ltx_video.run(
        torch.device("cpu"),
        "small",
        rounds=1,
        progress=False,
        dtype=torch.float32,
        **SMALL,
        **TINY,
    )
    rows = {s["variant"]: s for s in result["summary"]}
    assert list(rows) == ["unpatched", "exact", "sparse 0.5", "sparse 0.75", "sparse 0.75 perm"]
    assert rows["exact"]["bitwise_equal"] and rows["exact"]["realised_density"] is None
    sparse = rows["sparse 0.5"]
    assert sparse["requested_density"] == 0.5
    assert abs(sparse["realised_density"] - 0.5) <= 1 / 16  # within one block of a row
    assert not sparse["bitwise_equal"] and sparse["cosine"] > 0.9
    assert all(s["median_seconds"] > s["median_attention_seconds"] > 0 for s in rows.values())
    assert result["video_tokens"] == 128 and result["padded_text_tokens"] == 2
    json.dumps(result)


def test_cli_runs_the_suite(monkeypatch: pytest.MonkeyPatch, tmp_path, capsys) -> None:
    tiny = {
        "config": {**ltx_video.SIZES["small"]["config"], **TINY},
        "latent": (2, 2, 2),
        "text_tokens": 4,
        "rounds": 1,
    }
    monkeypatch.setitem(ltx_video.SIZES, "small", tiny)
    path = tmp_path / "ltx.json"
    argv = ["bench", "ltx_video", "--no-progress", "--dtype", "float32", "--json", str(path)]
    assert cli.main(argv) == 0
    assert "== ltx_video (small): 8 video + 4 text tokens (1 padded)" in capsys.readouterr().out
    assert json.loads(path.read_text())["ltx_video"]["dtype"] == "float32"


def test_video_scaling_family_ltx_video(capsys) -> None:
    result = video_scaling.run(
        torch.device("cpu"),
        (64, 128),
        family="ltx_video",
        text_tokens=4,
        block_size=16,
        frame=(4, 4),
        dtype=torch.float32,
        progress=False,
        **TINY,
    )
    assert [(r["video_tokens"], r["frames"]) for r in result["rows"]] == [(64, 4), (128, 8)]
    assert all(0 < r["attention_s"] < r["forward_s"] for r in result["rows"])
    assert [p["video_tokens"] for p in result["projection"]] == [16 * 16 * 24, 16 * 22 * 38]
    video_scaling.print_report(result)
    assert "LTX-Video geometry" in capsys.readouterr().out
