"""benchmarks/gpu/run_all.py, the one command a lent GPU runs, dry-run on CPU at tiny shapes.

The dry run dispatches CPU tensors as CUDA (Triton's interpreter, set up by
tests/conftest.py) and compiles with the eager backend: every section must run to its
end and record what a device run would, so the script cannot crash on the day for a
reason a CPU can see.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_gpu_script_dry_runs_every_section(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("run_all", ROOT / "benchmarks/gpu/run_all.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main([str(tmp_path), "--dry-run"])
    result = json.loads((tmp_path / "gpu_all.json").read_text())
    assert not [k for k in result if k.endswith(("_error", "_cut", "_skipped"))], result.keys()
    ops = result["ops"]
    assert {r["precision"] for r in ops} == {"exact", "fast"}
    assert len(ops) == 2 * 11  # every Wan and FLUX op, both precisions
    fast_paths = {r["path"] for r in ops if r["precision"] == "fast"}
    assert "forward_cuda" in fast_paths  # the Triton kernels ran (interpreted)
    for r in ops:
        timed = ("meaning_ms", "compile_ms", "ditops_ms", "tuned_ms", "copy_ms")
        assert all(r[k] > 0 for k in timed)
    # The tuner ran in the dry run too; each choice it made is recorded with its reason
    # (none is right when every competitor's bits differ: timing never changes a result).
    assert isinstance(result["tuned"], dict)
    assert all(v["winner"] and v["why"] for v in result["tuned"].values())
    (att,) = result["attention"]
    assert {"dense_ms", "sparse_ms_keep0.25", "estimate_share_of_dense"} <= att.keys()
    assert len(result["per_call"]) == 3
    models = result["models"]
    assert set(models["wan"]["ms"]) == {"unpatched", "exact", "fast", "sparse 0.75"}
    assert {r["variant"] for r in models["flux"]["summary"]} >= {"unpatched", "exact", "fast"}
