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
    results = list(
        run_cases(
            tiny_cases(torch.device("cpu"), "small"),
            torch.device("cpu"),
            n_steps=1,
            desc="masks",
            progress=False,
            min_seconds=0.0,
        )
    )
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
    argv = ["bench", "masks", "--no-progress", "--min-seconds", "1e-9", "--device", "cpu"]
    assert cli.main([*argv, "--plot", str(png), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "/row or" in text and "sampled_head" in text
    assert png.stat().st_size > 1000
    payload = json.loads(out.read_text())
    assert {s["method"] for s in payload["masks_summary"]} == set(METHODS)


TINY_WAN = {
    "num_attention_heads": 2,
    "attention_head_dim": 16,
    "text_dim": 16,
    "freq_dim": 16,
    "ffn_dim": 48,
    "in_channels": 4,
    "out_channels": 4,
    "rope_max_seq_len": 64,
}


def test_wan_model_qkv_is_what_attn1_attends() -> None:
    """The captured q, k, v give attn1's output: dense attention, then to_out."""
    from ditops.bench import wan_model

    model = wan_model.build_model(None, torch.device("cpu"), torch.float32, **TINY_WAN)
    outs: list[torch.Tensor] = []
    model.blocks[1].attn1.register_forward_hook(lambda m, a, o: outs.append(o))
    store: list = []
    attn = model.blocks[1].attn1
    attn.set_processor(masks._CaptureQKV(attn.processor, store))
    config = {**wan_model.DEFAULT_CONFIG, **TINY_WAN}
    with torch.inference_mode():
        model(**wan_model.make_inputs(config, (3, 16, 16), 8, "cpu", torch.float32))
        q, k, v = store[0]
        assert q.shape == (1, 2, 3 * 8 * 8, 16)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2)
        torch.testing.assert_close(attn.to_out[0](o.flatten(2)), outs[0], atol=1e-5, rtol=1e-4)


def test_wan_model_cases_have_every_method_and_keep() -> None:
    cpu = torch.device("cpu")
    cases = masks.wan_model_cases(
        cpu, torch.float32, latent=(3, 16, 16), text_tokens=8, stride=4, samples=2, **TINY_WAN
    )
    results = list(run_cases(cases, cpu, n_steps=1, desc="masks", progress=False, min_seconds=0.0))
    summ = masks.summary(ratios(results))
    assert {(s["case"].split()[1], s["keep"]) for s in summ} == {
        (b, keep) for b in ("b0", "b1") for keep in (0.5, 0.25)
    }
    assert len(summ) == 4 * len(METHODS)
    assert {r.params["block_size"] for r in results} == {16}  # 192 tokens: 12 blocks of 16
    for s in summ:
        assert s["case"].startswith("wan_model ")
        assert 0 < s["mass_kept"] <= 1 + 1e-6
        assert 0 < s["mass_vs_row"] <= 1 + 1e-6 and 0 < s["mass_vs_head"] <= 1 + 1e-6
        assert s["err_vs_row_oracle"] > 0


def test_scattered_cases_compare_both_orders_and_the_mass_target(tmp_path, capsys) -> None:
    cases = masks.scattered_cases(
        torch.device("cpu"),
        torch.float32,
        shape=(6, 8, 16),
        keeps=(0.3,),
        heads=4,
        dim=64,
        block_size=64,
        samples=2,
    )
    results = list(
        run_cases(
            cases, torch.device("cpu"), n_steps=1, desc="masks", progress=False, min_seconds=0.0
        )
    )
    summ = masks.summary(ratios(results))
    by = {(s["case"].split()[-1], s["method"]): s for s in summ}
    plain, perm = by[("keep=0.3", "sampled")], by[("keep=0.3", "perm sampled")]
    assert abs(plain["density"] - perm["density"]) < 1e-9  # the same density in both orders
    assert perm["unpermuted_row_oracle_err"] == plain["row_oracle_err"]
    assert perm["rel_err"] < plain["rel_err"]
    for m in ("mass sampled", "mass sampled_head", "perm mass sampled", "perm mass sampled_head"):
        s = by[("mass=0.95", m)]
        assert 0 < s["density"] < 1 and 0 < s["fixed_density_same_mass"] <= 1
        assert s["fixed_density_coverage"] >= s["mass_kept"] - 1e-9
    masks.print_summary(summ)
    assert "err/unp" in capsys.readouterr().out
    masks.plot(summ, str(tmp_path / "m.png"))
    assert (tmp_path / "m_scattered.png").stat().st_size > 1000
