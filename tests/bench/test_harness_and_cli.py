"""The benchmark harness, the ``ditops`` command, and the Wan suite on a tiny model."""

from __future__ import annotations

import io
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ditops import cli, config
from ditops.bench import harness, suites, wan, wan_model, wan_probes, wan_report
from ditops.bench.harness import Case, ratios, run_cases


def test_ratios_from_one_run() -> None:
    x = torch.randn(256, 256)
    case = Case(
        suite="toy",
        name="256x256",
        variants={"native": lambda: x * 2, "fast": lambda: x + x, "clone": x.clone},
        bytes_moved=2 * x.numel() * 4,
    )
    results = list(
        run_cases(
            [case], torch.device("cpu"), n_steps=3, desc="toy", progress=False, min_seconds=0.01
        )
    )
    assert [r.variant for r in results] == ["native", "fast", "clone"]
    rows = {r["variant"]: r for r in ratios(results)}
    assert rows["native"]["vs_native"] == pytest.approx(1.0)
    assert rows["fast"]["vs_native"] == pytest.approx(
        rows["native"]["median_ms"] / rows["fast"]["median_ms"]
    )
    assert rows["clone"]["of_clone_bw"] == pytest.approx(1.0)
    assert rows["fast"]["vs_compile"] is None  # no compile variant in this case
    assert all(r["cpu_ms"] >= 0 for r in rows.values())
    assert rows["native"]["vs_native_cpu"] == pytest.approx(1.0)


def test_a_failing_variant_is_reported_not_fatal() -> None:
    def boom() -> None:
        raise RuntimeError("kernel exploded")

    case = Case(suite="toy", name="c", variants={"native": lambda: None, "broken": boom})
    results = list(
        run_cases(
            [case], torch.device("cpu"), n_steps=2, desc="toy", progress=False, min_seconds=0.0
        )
    )
    assert results[1].error == "RuntimeError: kernel exploded" and math.isnan(results[1].median_s)


def test_info_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["info", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    ops = {(d["op"], d["device_kind"]): d for d in payload["ops"]}
    assert ops[("fp32_layer_norm", "cpu")]["chosen"] == "forward_cpu"
    assert ops[("fp32_layer_norm", "mps")]["chosen"] == "forward_native"
    assert payload["platform"]["visible_devices"]["cpu"] == 1
    assert {"block_sparse_attention", "gated_residual"} <= {d["op"] for d in payload["ops"]}


def test_info_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["info", "--precision", "exact"]) == 0
    out = capsys.readouterr().out
    assert "fp32_layer_norm" in out and "does not promise precision='exact'" in out


def test_bench_rejects_unknown_suite(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "nope"]) == 2
    assert "unknown suite(s) nope" in capsys.readouterr().err


def test_wan_suite_on_a_tiny_model(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    tiny = {
        **wan_model.DEFAULT_CONFIG,
        "num_attention_heads": 2,
        "attention_head_dim": 16,
        "text_dim": 16,
        "freq_dim": 16,
        "ffn_dim": 48,
        "in_channels": 4,
        "out_channels": 4,
        "rope_max_seq_len": 64,
    }
    monkeypatch.setattr(wan_model, "DEFAULT_CONFIG", tiny)
    # 5 frames of 16 x 16 tokens: 10 blocks of 128, the first frame 2 of them (forced
    # blocks 0.44 of the map: sparsity 0.75 and 0.9 run them alone, 0.5 runs 0.5).
    monkeypatch.setattr(wan, "LATENTS", {"small": (1, 4, 5, 32, 32)})
    monkeypatch.setattr(wan, "STEPS", {"small": 3})
    monkeypatch.setattr(wan, "TEXT_TOKENS", 8)
    plot = tmp_path / "wan.png"
    # The meaning of the sparse attention: the bench's logic is under test, not
    # FlexAttention (whose compile takes longer than the rest).
    with config.override(custom_ops="-block_sparse_attention"):
        result = wan.run(
            torch.device("cpu"), "small", progress=False, plot_path=str(plot), dtype=torch.float32
        )
    summary = {s["variant"]: s for s in result["summary"]}
    assert summary["norms exact"]["bitwise_equal"]  # the exact patch changes no bit
    assert not summary["sparse 0.5"]["bitwise_equal"] and summary["sparse 0.5"]["min_cosine"] > 0.9
    assert [r["dense"] for r in result["rows"] if r["variant"] == "sparse 0.5"] == [
        True,
        False,
        False,
    ]
    # What ran is what was asked for, or the forced blocks alone when they are more.
    assert summary["sparse 0.5"]["realised_density"] == pytest.approx(0.5)
    assert summary["sparse 0.75"]["realised_density"] == pytest.approx(0.44)
    # The reuse variant estimates at sparse step 1, reuses at 2; drift from per-step known.
    reuse = [r for r in result["rows"] if r["variant"] == "sparse 0.75 /2"]
    assert [r["kind"] for r in reuse] == ["dense (norms exact)", "estimate", "reuse"]
    assert [r["attention"]["estimates"] for r in reuse[1:]] == [2, 0]  # 2 layers
    assert summary["sparse 0.75 /2"]["vs_per_step"] is not None
    # The permuted variant: the same density as sparse 0.75, its drift from it known.
    perm = summary["sparse 0.75 perm"]
    assert perm["realised_density"] == pytest.approx(summary["sparse 0.75"]["realised_density"])
    assert perm["vs_per_step"] is not None
    # Where the time goes: estimate and attention inside the self-attention section.
    s5 = summary["sparse 0.5"]
    assert 0 < s5["estimate_s"] and 0 < s5["attention_s"]
    assert s5["estimate_s"] + s5["attention_s"] <= s5["sparse_step_sections"]["self-attention"]
    assert summary["unpatched"]["dense_attention_s"] is None
    assert all(r["attention"]["dense_s"] > 0 for r in result["rows"] if r["dense"])
    assert set(summary["unpatched"]["mean_sections"]) == set(wan_probes.SECTIONS.values())
    assert result["video_tokens"] == 5 * 16 * 16
    assert "capability" in result["machine"]["cpu_features"]
    assert plot.stat().st_size > 1000
    text = io.StringIO()
    wan_report.print_report(result, out=text)
    report = text.getvalue()
    assert "target: sparsity 0.75 at >= 1.8x per sparse step" in report
    assert "sparse 0.75 /2: against estimating at every step" in report
    assert "mask method 'sampled', samples 4" in report  # the estimator's method is named
    assert result["mask_method"] == {"method": "sampled", "samples": 4}


def test_bench_wan_without_diffusers_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "diffusers", None)  # import diffusers -> ImportError
    assert cli.main(["bench", "wan", "--no-progress"]) == 2
    assert "pip install 'ditops[bench]'" in capsys.readouterr().err


def test_bench_wan_model_path_must_exist(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no-such-checkpoint"
    assert cli.main(["bench", "wan", "--model", str(missing), "--no-progress"]) == 2
    assert "is not a directory holding a diffusers checkpoint" in capsys.readouterr().err


def test_bench_wan_model_folder_without_config(tmp_path, capsys) -> None:
    assert cli.main(["bench", "wan", "--model", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "has no config.json" in err and "Traceback" not in err


def test_bench_wan_model_needing_accelerate_says_so(
    tmp_path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    import importlib.util

    (tmp_path / "config.json").write_text("{}")
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else real(name)
    )
    assert cli.main(["bench", "wan", "--model", str(tmp_path), "--no-progress"]) == 2
    assert "needs accelerate: pip install accelerate" in capsys.readouterr().err


def test_bench_wan_loads_a_saved_checkpoint_keeping_fp32_modules(tmp_path) -> None:
    from diffusers import WanTransformer3DModel

    from tests.integrations.test_diffusers_wan import TINY

    WanTransformer3DModel(**TINY).save_pretrained(tmp_path)
    model = wan_model.build_model(str(tmp_path), torch.device("cpu"), torch.bfloat16)
    built = wan_model.cast_like_from_pretrained(WanTransformer3DModel(**TINY), torch.bfloat16)
    dtypes = {n: p.dtype for n, p in model.state_dict().items()}
    assert dtypes == {n: p.dtype for n, p in built.state_dict().items()}
    assert dtypes["blocks.0.scale_shift_table"] == torch.float32
    assert dtypes["blocks.0.ffn.net.0.proj.weight"] == torch.bfloat16


def test_default_model_is_built_without_diffusers_fp32_warning(caplog) -> None:
    import logging

    from tests.integrations.test_diffusers_wan import TINY

    with caplog.at_level(logging.WARNING):
        from diffusers import WanTransformer3DModel

        wan_model.cast_like_from_pretrained(WanTransformer3DModel(**TINY), torch.bfloat16)
    assert not any("kept in float32" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"DITOPS_PRECISION": "quick"}, "expected 'fast' or 'exact'"),
        ({"DITOPS_CUSTOM_OPS": "+nope"}, "names unknown op(s) nope"),
        ({"DITOPS_STRICT": "maybe"}, "is not a boolean"),
    ],
)
def test_info_with_a_bad_environment_prints_one_line(env: dict, fragment: str) -> None:
    import os
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "ditops", "info"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert fragment in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_info_into_a_closed_pipe_is_quiet() -> None:
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-m", "ditops", "info"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.close()  # the reader leaves before the first line (like `| head -0`)
    err = proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert "BrokenPipeError" not in err and "Traceback" not in err


def test_version(capsys) -> None:
    import ditops

    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"ditops {ditops.__version__}"


# --- both glibc malloc states -------------------------------------------------------------


def test_malloc_state_and_env() -> None:
    assert harness.malloc_state({}) == "grows"
    assert harness.malloc_state({"MALLOC_MMAP_THRESHOLD_": "131072"}) == "fixed"
    assert harness.malloc_state({"GLIBC_TUNABLES": "glibc.malloc.top_pad=0"}) == "fixed"
    assert harness.malloc_state({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"}) == "grows"
    base = {"PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=4096:glibc.x.y=1"}
    fixed = harness.malloc_env("fixed", base)
    assert fixed["MALLOC_MMAP_THRESHOLD_"] == "131072" and fixed["PATH"] == "/bin"
    assert fixed["GLIBC_TUNABLES"] == "glibc.x.y=1"
    grows = harness.malloc_env("grows", {**base, "MALLOC_MMAP_THRESHOLD_": "131072"})
    assert "MALLOC_MMAP_THRESHOLD_" not in grows and harness.malloc_state(grows) == "grows"
    with pytest.raises(ValueError, match="malloc state must be one of"):
        harness.malloc_env("huge")


def _toy_cases(device: torch.device, size: str) -> Iterator[Case]:
    x = torch.randn(64, 64)
    yield Case(
        suite="toy_alloc",
        name="64x64",
        variants={"native": lambda: x * 2, "exact": lambda: x + x, "clone": x.clone},
        bytes_moved=2 * x.numel() * 4,
    )


def test_every_listed_suite_is_defined_by_its_module() -> None:
    for name, module in suites.SUITES.items():
        suite = suites.get_suite(name)
        assert suite.name == name and sys.modules[module].SUITE is suite


@pytest.mark.parametrize("mode", ["both", "current"])
def test_bench_runs_malloc_suites_in_both_states(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    mode: str,
) -> None:
    toy = suites.Suite("toy_alloc", "toy", _toy_cases, lambda size: 3, malloc_states=True)
    monkeypatch.setitem(suites.SUITES, "toy_alloc", __name__)  # this module's SUITE
    monkeypatch.setattr(sys.modules[__name__], "SUITE", toy, raising=False)
    monkeypatch.setattr(cli, "glibc", lambda: True)
    here = harness.malloc_state()
    other = "grows" if here == "fixed" else "fixed"
    children: list[list[str]] = []

    def child(argv: list[str], env: dict[str, str]) -> int:
        # The child ``python -m ditops bench``, run in this process in the child's state.
        assert argv[:4] == [sys.executable, "-m", "ditops", "bench"]
        assert harness.malloc_state(env) == other
        children.append(argv)
        with pytest.MonkeyPatch.context() as mp:
            for key in ("MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES"):
                if key in env:
                    mp.setenv(key, env[key])
                else:
                    mp.delenv(key, raising=False)
            return cli.main(argv[3:])

    monkeypatch.setattr(harness, "run_child", child)
    out_json = tmp_path / "bench.json"
    argv = ["bench", "toy_alloc", "--min-seconds", "1e-9", "--no-progress", "--malloc", mode]
    assert cli.main([*argv, "--json", str(out_json)]) == 0
    rows = json.loads(out_json.read_text())["rows"]
    text = capsys.readouterr().out.split("== toy_alloc")[-1]  # the parent's table
    if mode == "current":
        assert children == [] and {r["malloc"] for r in rows} == {here}
        return
    assert len(children) == 1 and children[0][children[0].index("--malloc") + 1] == "current"
    assert [r["malloc"] for r in rows] == [here] * 3 + [other] * 3
    assert all(r["vs_native"] > 0 for r in rows)
    assert f"(malloc: {other}," in text and "x native in each malloc state" in text


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--device", "cuda"], "--device cuda is not usable here"),
        (["--device", "nodevice"], "--device nodevice is not a torch device"),
        (["--device", "meta"], "--device meta holds no data"),
        (["--json", "/nonexistent-ditops/x.json"], "the folder /nonexistent-ditops does not exist"),
        (["--plot", "/nonexistent-ditops/p.png"], "the folder /nonexistent-ditops does not exist"),
        (["--json", "."], "is a directory"),
        (["--json", ""], "--json is empty"),
        (["--device", ""], "--device is empty"),
    ],
)
def test_bad_bench_arguments_are_one_line_and_exit_2_before_any_benchmark(
    argv: list[str], fragment: str, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ditops.bench import harness

    def never(*a: object, **k: object) -> None:
        raise AssertionError("a benchmark ran before the arguments were checked")

    monkeypatch.setattr(harness, "run_cases", never)
    assert cli.main(["bench", "layer_norm", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert fragment in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("value", ["-1", "0", "-0.0", "nan", "inf", "-inf", "1e999", "abc", ""])
def test_a_time_that_is_not_a_positive_number_exits_2_before_anything_runs(
    value: str, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every numeric option of the command (--min-seconds is the only one): argparse
    refuses what is not a positive finite number, naming the option."""
    from ditops.bench import harness

    def never(*a: object, **k: object) -> None:
        raise AssertionError("a benchmark ran with a bad --min-seconds")

    monkeypatch.setattr(harness, "run_cases", never)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "layer_norm", f"--min-seconds={value}"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--min-seconds" in err and "a positive number of seconds" in err, err


def test_a_positive_time_is_taken() -> None:
    args = cli.build_parser().parse_args(["bench", "layer_norm", "--min-seconds", "0.25"])
    assert args.min_seconds == 0.25


def test_bench_busy_prints_the_machine_load_and_tuned_choices(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``--busy`` runs the cases while another process spins (seen from inside a case),
    and only then: it is gone after the run. The output opens with the machine
    fingerprint and the load at start, and ends with the tuned choices."""
    import subprocess as sp

    from ditops.bench import load

    spinners: list[sp.Popen] = []
    real_popen = sp.Popen

    def popen(*a, **kw):
        proc = real_popen(*a, **kw)
        spinners.append(proc)
        return proc

    monkeypatch.setattr(load.subprocess, "Popen", popen)
    alive_in_case: list[bool] = []

    def cases(device: torch.device, size: str) -> Iterator[Case]:
        x = torch.randn(8, 8)
        alive_in_case.append(bool(spinners) and spinners[0].poll() is None)
        yield Case(suite="toy_busy", name="8x8", variants={"native": x.clone}, bytes_moved=1)

    toy = suites.Suite("toy_busy", "toy", cases, lambda size: 1)
    monkeypatch.setitem(suites.SUITES, "toy_busy", __name__)
    monkeypatch.setattr(sys.modules[__name__], "SUITE", toy, raising=False)
    out_json = tmp_path / "b.json"
    argv = ["bench", "toy_busy", "--busy", "--min-seconds", "1e-9", "--no-progress"]
    assert cli.main([*argv, "--json", str(out_json)]) == 0
    assert alive_in_case == [True]
    assert spinners[0].poll() is not None  # killed at the end
    out = capsys.readouterr().out
    assert out.startswith("machine: ") and "load average at start: " in out
    assert "busy neighbour" in out and "tuned choices (DITOPS_TUNE=" in out
    machine = json.loads(out_json.read_text())["machine"]
    assert machine["busy_neighbour"] is True and "cpu_flags" in machine["fingerprint"]
