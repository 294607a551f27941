"""``ditops bench cogvideox`` and ``video_scaling --family cogvideox`` on tiny configs."""

from __future__ import annotations

import json

import pytest
import torch

from ditops import cli
from ditops.bench import cogvideox, video_scaling

pytest.importorskip("diffusers", reason="the diffusers extra is part of the test install")

TINY = dict(
    attention_head_dim=16,
    num_attention_heads=2,
    in_channels=4,
    out_channels=4,
    time_embed_dim=16,
    text_embed_dim=8,
    max_text_seq_length=8,
)


@pytest.mark.parametrize("layout", ["1.0", "1.5"])
def test_run_reports_every_variant_with_density_and_drift(layout: str) -> None:
    # 8 token frames of 4 x 4 (128 video tokens), 8 text tokens: blocks of 8
    result = cogvideox.run(
        torch.device("cpu"),
        "small",
        layout,
        rounds=2,
        tokens=(8, 4, 4),
        block_size=8,
        progress=False,
        dtype=torch.float32,
        **TINY,
    )
    rows = {s["variant"]: s for s in result["summary"]}
    assert list(rows) == ["unpatched", "exact", "sparse 0.5", "sparse 0.75"]
    assert rows["unpatched"]["speedup"] == 1.0 and rows["exact"]["bitwise_equal"]
    assert rows["exact"]["requested_density"] is None and rows["exact"]["realised_density"] is None
    sparse = rows["sparse 0.5"]
    assert sparse["requested_density"] == 0.5
    assert abs(sparse["realised_density"] - 0.5) <= 1 / 17  # within one block of a row
    assert not sparse["bitwise_equal"] and sparse["cosine"] > 0.9
    assert all(len(v) == 2 for v in result["seconds"].values())
    assert all(s["median_seconds"] > s["median_attention_seconds"] > 0 for s in rows.values())
    assert result["video_tokens"] == 128 and result["layout"] == layout
    assert result["config"].get("patch_size_t") == (2 if layout == "1.5" else None)
    json.dumps(result)


def test_bad_layout_is_refused() -> None:
    with pytest.raises(ValueError, match="layout must be one of"):
        cogvideox.run(torch.device("cpu"), "small", "2.0")


def test_cli_runs_both_layouts(monkeypatch: pytest.MonkeyPatch, tmp_path, capsys) -> None:
    tiny = {
        "config": {**cogvideox.SIZES["small"]["config"], **TINY},
        "tokens": (2, 2, 2),
        "rounds": 1,
    }
    monkeypatch.setitem(cogvideox.SIZES, "small", tiny)
    path = tmp_path / "cv.json"
    argv = ["bench", "cogvideox", "--no-progress", "--dtype", "float32", "--json", str(path)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "== cogvideox 1.0 (small): 8 video + 8 text tokens" in out
    assert "== cogvideox 1.5 (small): 8 video + 8 text tokens" in out
    payload = json.loads(path.read_text())
    assert set(payload["cogvideox"]) == {"1.0", "1.5"}


def test_video_scaling_times_the_joint_attention_and_projects(capsys) -> None:
    result = video_scaling.run(
        torch.device("cpu"),
        (64, 128),
        family="cogvideox",
        text_tokens=8,
        block_size=16,
        frame=(8, 8),
        dtype=torch.float32,
        progress=False,
        **TINY,
    )
    assert [(r["video_tokens"], r["frames"]) for r in result["rows"]] == [(64, 4), (128, 8)]
    for r in result["rows"]:
        assert 0 < r["attention_s"] < r["forward_s"] and 0 < r["sparse_attention_s"]
    proj = result["projection"]
    assert [p["video_tokens"] for p in proj] == [17550, 44880]
    assert 0 < proj[0]["attention_share"] < proj[1]["attention_share"] < 1
    video_scaling.print_report(result)
    assert "CogVideoX-5B geometry (1.0 layout), 1 block" in capsys.readouterr().out
    json.dumps(result)
