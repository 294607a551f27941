"""``ditops bench --quick``: offline, tiny pipelines, bitwise, density, speedup, what next."""

from __future__ import annotations

import json

import pytest

from ditops import cli

pytest.importorskip("transformers", reason="pip install -e '.[test]' installs it")


@pytest.mark.slow  # two tiny pipelines (the real run's video is shrunk here)
def test_quick_mode_reports_bitwise_density_speed_and_next_steps(
    monkeypatch: pytest.MonkeyPatch, tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ditops.bench import quick

    # 9 latent frames of 8 x 8 tokens: 5 blocks of 128, enough for a sparse mask
    monkeypatch.setattr(quick, "SPEED_CALL", {"num_frames": 33, "height": 128, "width": 128})
    monkeypatch.setattr(quick, "SPEED_STEPS", 2)
    out = tmp_path / "quick.json"
    assert cli.main(["bench", "--quick", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "frames unpatched vs patched: bitwise equal" in text
    assert "block density" in text and "x (latents' PSNR" in text
    assert "next: ditops bench" in text and "ditops info" in text
    result = json.loads(out.read_text())
    assert result["bitwise"]["bitwise_equal"] is True
    assert result["sparse"]["sparse_steps"] == 1
    assert 0 < result["sparse"]["density"] <= 1 and result["sparse"]["speedup"] > 0


def test_quick_mode_without_transformers_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from ditops.bench import tiny

    found = tiny.importlib.util.find_spec
    monkeypatch.setattr(
        tiny.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "transformers" else found(name, *a),
    )
    assert cli.main(["bench", "--quick"]) == 2
    assert "pip install 'ditops[pipelines]'" in capsys.readouterr().err


def test_quick_mode_refuses_what_it_would_ignore(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "--quick", "flux"]) == 2
    assert "drop SUITE" in capsys.readouterr().err
    assert cli.main(["bench", "--quick", "--model", "/nowhere"]) == 2
    assert cli.main(["bench", "--quick", "--parallel", "ulysses"]) == 2
