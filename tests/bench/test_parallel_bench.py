"""``ditops bench --parallel``: launch errors, the cost model, and a run on 2 gloo ranks
(a tiny model and video; the ranks are forked as torchrun would start them)."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

from ditops import cli
from ditops.bench import parallel, wan, wan_model
from tests.integrations.process_group import run_group
from tests.integrations.test_diffusers_wan import TINY as TINY_WAN

pytest.importorskip("diffusers", reason="the diffusers extra is part of the test install")
# imported here, before the ranks fork, so that each does not import them again (~5 s)
from diffusers import ContextParallelConfig, WanTransformer3DModel  # noqa: F401

#: the bench's model (qk norm, eps) at the test model's sizes
TINY = {**wan_model.DEFAULT_CONFIG, **TINY_WAN}


def test_parallel_without_torchrun_says_how_to_launch(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert cli.main(["bench", "--parallel", "ulysses", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "torchrun --nproc-per-node 2 -m ditops bench --parallel ulysses" in err
    assert cli.main(["bench", "attention", "--parallel", "ring"]) == 2
    assert "--parallel runs the wan suite only" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("mode", "world", "fragment"),
    [("ulysses", 1, "at least 2 ranks"), ("unified", 2, "even number of ranks >= 4")],
)
def test_modes_need_enough_ranks(mode: str, world: int, fragment: str) -> None:
    with pytest.raises(parallel.LaunchError, match=fragment):
        parallel.context_parallel_config(mode, world)


def test_exchange_cost_against_a_hand_count() -> None:
    # 2 ranks, 8 tokens, 3 heads of 4, bf16, 1 layer: n = 4 tokens * 12 * 2 bytes = 96 bytes
    cost = parallel.exchange_cost(
        batch=1, tokens=8, heads=3, head_dim=4, layers=1, world=2, itemsize=2
    )
    assert cost["exchange_sent_mb"] * 1e6 == pytest.approx(4 * 96 / 2)  # q, k, v, out; half
    assert cost["qkv_held_per_call_mb"] * 1e6 == pytest.approx(3 * 96)
    assert cost["ring_allgather_received_mb"] * 1e6 == pytest.approx(2 * 96)
    assert cost["ring_kv_held_per_call_mb"] * 1e6 == pytest.approx(2 * 96 * 2)


def _bench_both_modes(rank: int, world: int) -> dict[str, Any]:
    import ditops

    # the forked rank's own copy of the module: no need to undo
    wan_model.DEFAULT_CONFIG = TINY
    wan.LATENTS = {"small": (1, 4, 4, 16, 16)}  # 256 tokens: 2 blocks of 128
    wan.STEPS = {"small": 2}
    wan.TEXT_TOKENS = 8
    wan.REPEATS = 1
    results = {}
    # native block-sparse attention: FlexAttention would compile per rank (~15 s)
    with ditops.override(custom_ops="-block_sparse_attention"):
        for mode in ("ulysses", "ring"):
            results[mode] = parallel.run(mode, torch.device("cpu"), "small", progress=False)
    return results


@pytest.mark.slow
def test_parallel_bench_on_two_ranks() -> None:
    ranks = run_group(_bench_both_modes, 2)
    ulysses, ring = ranks[0]["ulysses"], ranks[0]["ring"]
    summary = {s["variant"]: s for s in ulysses["summary"]}
    assert set(summary) == {"unpatched", "norms exact", "sparse 0.75"}
    assert summary["unpatched"]["bitwise_equal"] and summary["norms exact"]["bitwise_equal"]
    assert summary["sparse 0.75"]["max_abs"] <= 2e-2  # bf16, a few ulps of the output
    assert all(s["speedup"] > 0 for s in summary.values())
    assert not ulysses["refused"] and ulysses["degrees"] == {"ring": 1, "ulysses": 2}
    assert [r["dense"] for r in ulysses["rows"] if r["variant"] == "sparse 0.75"] == [True, False]
    # Ring on CPU: diffusers' native backend refuses it; ditops' sparse attention runs it
    assert set(ring["refused"]) == {"unpatched", "norms exact"}
    assert all("return_lse" in why for why in ring["refused"].values())
    sparse = {s["variant"]: s for s in ring["summary"]}["sparse 0.75"]
    assert sparse["max_abs"] <= 2e-2 and sparse["speedup"] > 0
    out = io.StringIO()
    parallel.print_report(ring, out)
    text = out.getvalue()
    assert "refused by diffusers under ring: unpatched: ValueError" in text
    assert "diffusers' Ring would receive" in text and "peak memory per rank" in text
