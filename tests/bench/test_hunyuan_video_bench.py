"""``ditops bench hunyuan_video``: the suite on a tiny config, and its place in the command."""

from __future__ import annotations

import json

import pytest
import torch

from ditops import cli
from ditops.bench import hunyuan_video

pytest.importorskip("diffusers", reason="the diffusers extra is part of the test install")

TINY = dict(
    attention_head_dim=16,
    num_attention_heads=2,
    rope_axes_dim=(4, 6, 6),
    in_channels=4,
    out_channels=4,
    text_embed_dim=16,
    pooled_projection_dim=8,
)
# 8 frames of 4 x 4 tokens (128 video tokens), 8 text (2 padded): blocks of 8
SMALL = dict(latent=(8, 8, 8), text_tokens=8, block_size=8)


def test_run_reports_every_variant_with_density_and_drift() -> None:
    result = hunyuan_video.run(
        torch.device("cpu"),
        "small",
        rounds=2,
        progress=False,
        dtype=torch.float32,
        **SMALL,
        **TINY,
    )
    rows = {s["variant"]: s for s in result["summary"]}
    assert list(rows) == ["unpatched", "exact", "sparse 0.5", "sparse 0.75", "sparse 0.75 perm"]
    perm = rows["sparse 0.75 perm"]  # the permuted mode: the same density, its own drift
    assert perm["requested_density"] == 0.25
    assert perm["realised_density"] == pytest.approx(rows["sparse 0.75"]["realised_density"])
    assert not perm["bitwise_equal"] and perm["cosine"] > 0.9
    assert rows["unpatched"]["speedup"] == 1.0 and rows["exact"]["bitwise_equal"]
    assert rows["exact"]["requested_density"] is None and rows["exact"]["realised_density"] is None
    sparse = rows["sparse 0.5"]
    assert sparse["requested_density"] == 0.5
    assert abs(sparse["realised_density"] - 0.5) <= 1 / 16  # within one block of a row
    assert not sparse["bitwise_equal"] and sparse["cosine"] > 0.9
    assert all(len(v) == 2 for v in result["seconds"].values())
    assert all(s["median_seconds"] > s["median_attention_seconds"] > 0 for s in rows.values())
    assert result["video_tokens"] == 128 and result["padded_text_tokens"] == 2
    json.dumps(result)


def test_bad_size_is_refused() -> None:
    with pytest.raises(ValueError, match="size must be one of"):
        hunyuan_video.run(torch.device("cpu"), "huge")


def test_cli_runs_the_suite(monkeypatch: pytest.MonkeyPatch, tmp_path, capsys) -> None:
    tiny = {
        "config": {**hunyuan_video.SIZES["small"]["config"], **TINY},
        "latent": (2, 4, 4),
        "text_tokens": 4,
        "rounds": 1,
    }
    monkeypatch.setitem(hunyuan_video.SIZES, "small", tiny)
    path = tmp_path / "hv.json"
    argv = ["bench", "hunyuan_video", "--no-progress", "--dtype", "float32", "--json", str(path)]
    assert cli.main(argv) == 0
    assert "== hunyuan_video (small): 8 video + 4 text tokens (1 padded)" in capsys.readouterr().out
    payload = json.loads(path.read_text())
    assert payload["hunyuan_video"]["dtype"] == "float32"


def test_video_scaling_measures_each_length_and_projects(capsys) -> None:
    from ditops.bench import video_scaling

    result = video_scaling.run(
        torch.device("cpu"),
        (64, 128),
        text_tokens=4,
        block_size=16,
        frame=(8, 8),
        dtype=torch.float32,
        progress=False,
        **TINY,
    )
    rows = result["rows"]
    assert [r["video_tokens"] for r in rows] == [64, 128]  # frames of 4 x 4 tokens
    assert all(0 < r["attention_share"] < 1 and r["attention_speedup"] > 0 for r in rows)
    proj = result["projection"]
    assert [p["video_tokens"] for p in proj] == [52470, 118800]
    # attention grows as N^2, the rest as N: its share rises with the video
    assert 0 < proj[0]["attention_share"] < proj[1]["attention_share"] < 1
    video_scaling.print_report(result)
    assert "PROJECTION, not a measurement" in capsys.readouterr().out
    json.dumps(result)
