"""Every Python block of the README and the docs runs as written, so none can rot.

A block is one of three kinds, by its first line:

* ``# excerpt: ...``: a fragment of a larger file (it says where); it must parse.
* ``# torchrun --nproc-per-node N FILE``: a script for several processes; it runs so, on
  this CPU host (gloo, ``OMP_NUM_THREADS=1``).
* anything else: runs as it stands, in a fresh namespace.

Where a block names a checkpoint, ``from_pretrained`` builds a tiny stand-in of it
(``tests/doc_setup.py``): random weights, no download, the real arithmetic.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
EXCERPT = "# excerpt:"
TORCHRUN = re.compile(r"^# torchrun --nproc-per-node (\d+) ")
#: Characters of code the site's column shows without scrolling (tests/test_site.py).
COLUMN = 78


def blocks() -> list[tuple[str, str]]:
    """(``page:line``, code) for every fenced Python block."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            line = text[: m.start()].count("\n") + 1
            found.append((f"{page.relative_to(ROOT)}:{line}", m.group(1)))
    return found


BLOCKS = blocks()
RUN = [(where, code) for where, code in BLOCKS if not code.startswith(EXCERPT)]
SCRIPTS = [(where, code) for where, code in RUN if TORCHRUN.match(code)]
PLAIN = [(where, code) for where, code in RUN if not TORCHRUN.match(code)]


def test_the_docs_have_blocks_of_each_kind() -> None:
    assert len(BLOCKS) >= 6 and SCRIPTS and PLAIN  # the collector finds them
    assert any(code.startswith(EXCERPT) for _, code in BLOCKS)


@pytest.mark.parametrize(("where", "code"), BLOCKS, ids=[w for w, _ in BLOCKS])
def test_every_block_parses_and_fits_the_column(where: str, code: str) -> None:
    ast.parse(code, filename=where)
    wide = [ln for ln in code.splitlines() if len(ln) > COLUMN]
    assert not wide, f"{where}: lines wider than the site's code column ({COLUMN}): {wide}"


@pytest.mark.slow  # a tiny pipeline per block: seconds each on 2 cores
@pytest.mark.parametrize(("where", "code"), PLAIN, ids=[w for w, _ in PLAIN])
def test_block_runs_as_written(where: str, code: str) -> None:
    pytest.importorskip("transformers", reason="pip install -e '.[test]' installs it")
    from tests.doc_setup import tiny_checkpoints

    with tiny_checkpoints():
        exec(compile(code, where, "exec"), {"__name__": "__doc_block__"})


@pytest.mark.slow  # two processes, each building a tiny pipeline
@pytest.mark.parametrize(("where", "code"), SCRIPTS, ids=[w for w, _ in SCRIPTS])
def test_script_runs_under_torchrun(where: str, code: str, tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="pip install -e '.[test]' installs it")
    procs = TORCHRUN.match(code).group(1)  # type: ignore[union-attr]
    script = tmp_path / "example.py"
    prelude = (
        f"import sys; sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'src')!r}]\n"
        "from tests.doc_setup import tiny_checkpoints\n"
        "_tiny = tiny_checkpoints()  # kept: a collected context would undo itself\n"
        "_tiny.__enter__()\n"
    )
    script.write_text(prelude + code)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    # --standalone: a free port of its own, so runs side by side do not collide
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    cmd += [procs, str(script)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{where} under torchrun:\n{done.stdout}\n{done.stderr[-4000:]}"


def test_the_extra_the_docs_name_installs_what_the_examples_import() -> None:
    """``pip install -e '.[pipelines]'`` (named by the README and Getting started) brings
    every package the runnable blocks import beyond torch and ditops."""
    line = re.search(r"^pipelines = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M)
    assert line, "pyproject.toml has no 'pipelines' extra"
    wanted = {re.split(r"[<>=!~ ;\[]", r.strip(' "'))[0] for r in line.group(1).split(",")}
    imported = set()
    for _, code in RUN:
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module.split(".")[0])
    outside = imported - {"torch", "ditops", "os", "sys"} - wanted
    assert not outside, f"the blocks import {outside}: add them to the pipelines extra"
    assert "transformers" in wanted  # diffusers' pipelines load their text encoders with it
    for page in ("README.md", "docs/getting-started.md"):
        assert "'.[pipelines]'" in (ROOT / page).read_text(), page
