"""``python -m ditops.bench.video_scaling --family wan``: a tiny one-layer Wan, two lengths."""

from __future__ import annotations

import json

import pytest
import torch

from ditops.bench import video_scaling

pytest.importorskip("diffusers", reason="the diffusers extra is part of the test install")

from tests.integrations.test_diffusers_wan import TINY

TINY_WAN = {**TINY, "num_layers": 1}


def test_wan_times_self_attention_and_projects_to_wan_token_counts(capsys) -> None:
    result = video_scaling.run(
        torch.device("cpu"),
        (64, 128),
        family="wan",
        text_tokens=8,
        block_size=16,
        frame=(8, 8),
        dtype=torch.float32,
        progress=False,
        **TINY_WAN,
    )
    assert result["family"] == "wan" and result["config"]["num_layers"] == 1
    assert result["text_tokens"] == 8 and result["config"]["patch_size"] == [1, 2, 2]
    rows = result["rows"]
    assert [(r["video_tokens"], r["frames"]) for r in rows] == [(64, 4), (128, 8)]
    for r in rows:  # attn1 is part of the forward; the rest (attn2, ffn, ...) is not empty
        assert 0 < r["attention_s"] < r["forward_s"] and 0 < r["sparse_attention_s"]
    proj = result["projection"]
    assert [(p["target"], p["video_tokens"]) for p in proj] == [
        ("480p (832x480)", 21 * 30 * 52),
        ("720p (1280x720)", 21 * 45 * 80),
    ]
    assert [p["video_tokens"] for p in proj] == [32760, 75600]
    assert 0 < proj[0]["attention_share"] < proj[1]["attention_share"] < 1
    video_scaling.print_report(result)
    out = capsys.readouterr().out
    assert "Wan2.1 geometry, 1 layer; attn: self-attention (attn1) only" in out
    assert "PROJECTION, not a measurement" in out and "32760 video tokens" in out
    json.dumps(result)


def test_unknown_family_is_refused() -> None:
    with pytest.raises(ValueError, match="family must be one of"):
        video_scaling.run(torch.device("cpu"), (64,), family="flux")


def test_cli_family_wan_writes_json(monkeypatch: pytest.MonkeyPatch, tmp_path, capsys) -> None:
    seen = {}
    real = video_scaling.run

    def tiny(device, tokens, **kw):
        seen.update(kw)
        return real(
            device, (64,), **{**kw, "text_tokens": 4, "block_size": 16, "frame": (8, 8), **TINY_WAN}
        )

    monkeypatch.setattr(video_scaling, "run", tiny)
    path = tmp_path / "vs.json"
    argv = ["--family", "wan", "--dtype", "float32", "--no-progress", "--json", str(path)]
    assert video_scaling.main(argv) == 0
    assert seen["family"] == "wan"
    assert "== video scaling (Wan2.1 geometry" in capsys.readouterr().out
    payload = json.loads(path.read_text())
    assert payload["family"] == "wan" and "machine" in payload
