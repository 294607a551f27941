"""The docs stay true to the code: generated tables are current, every op and family is
listed, the families declare what they do, and the README stays a front page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from torch import nn

import ditops
from ditops import docs_figures, docs_tables
from ditops.custom_op import registered_ops
from ditops.integrations import PatchError
from ditops.integrations.patching import FAMILIES

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
REGENERATE = f"run `{docs_tables.COMMAND}` from the repository root and commit the result"


@pytest.mark.parametrize("name", sorted(docs_tables.generated()))
def test_generated_page_is_current(name: str) -> None:
    committed = (DOCS / name).read_text() if (DOCS / name).exists() else None
    assert committed == docs_tables.generated()[name], f"docs/{name} is stale: {REGENERATE}"


def test_readme_families_table_is_current() -> None:
    readme = (ROOT / "README.md").read_text()
    assert readme == docs_tables.readme_with_families(readme), (
        f"README.md's families table is stale: {REGENERATE}"
    )


def _rows(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("| ") and not ln.startswith("| op ")]


def test_every_registered_op_is_in_the_op_table() -> None:
    table = (DOCS / "generated" / "ops.md").read_text()
    listed = {re.match(r"\| `(\w+)`", row).group(1) for row in _rows(table)}  # type: ignore[union-attr]
    shipped = {n for n, c in registered_ops().items() if c.__module__.startswith("ditops.")}
    assert shipped <= listed  # (tests register toy ops of their own: not listed)
    assert "gelu_tanh_bias" in listed  # the one the hand-kept table lost


def test_every_family_and_its_classes_are_in_the_families_tables() -> None:
    pages = [(DOCS / "generated" / "families.md").read_text(), (ROOT / "README.md").read_text()]
    for family in FAMILIES:
        for text in pages:
            assert f"| {family.name} |" in text
            for cls in family.model_classes:
                assert f"`{cls}`" in text


def _models() -> dict[str, nn.Module]:
    """A tiny model per family (diffusers' classes, random weights, no download)."""
    pytest.importorskip("diffusers")
    from tests.integrations.test_diffusers_chroma import tiny_chroma
    from tests.integrations.test_diffusers_cogvideox import tiny_cogvideox
    from tests.integrations.test_diffusers_flux import tiny_flux
    from tests.integrations.test_diffusers_flux2 import tiny_flux2
    from tests.integrations.test_diffusers_hunyuan_video import tiny_hunyuan
    from tests.integrations.test_diffusers_hunyuan_video15 import tiny_model
    from tests.integrations.test_diffusers_hunyuan_video_framepack import tiny as tiny_framepack
    from tests.integrations.test_diffusers_ltx2 import tiny_ltx2
    from tests.integrations.test_diffusers_ltx_video import tiny_ltx
    from tests.integrations.test_diffusers_mochi import tiny_mochi
    from tests.integrations.test_diffusers_qwen_image import tiny_qwen
    from tests.integrations.test_diffusers_sd3 import SD35, tiny_sd3
    from tests.integrations.test_diffusers_wan import tiny_wan
    from tests.integrations.test_diffusers_z_image import tiny_z_image

    return {
        "wan": tiny_wan(keep_fp32=True),
        "flux": tiny_flux(),
        "flux2": tiny_flux2(),
        "mochi": tiny_mochi(),
        "hunyuan_video": tiny_hunyuan(),
        "hunyuan_video15": tiny_model(),
        "hunyuan_video_framepack": tiny_framepack(),
        "ltx_video": tiny_ltx(),
        "ltx2": tiny_ltx2(),
        "sd3": tiny_sd3(**SD35),
        "chroma": tiny_chroma(),
        "qwen_image": tiny_qwen(),
        "z_image": tiny_z_image(),
        "cogvideox": tiny_cogvideox(),
        "generic": nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)),
    }


@pytest.mark.slow  # builds a tiny model of each family (about 10 s on 2 loaded cores)
def test_families_do_what_they_declare() -> None:
    """The families table reads ``model_classes`` and ``sparse_attention``: a model of
    each class is recognised by its family, and sparse attention is patched or refused
    as declared."""
    models = _models()
    assert set(models) == {f.name for f in FAMILIES}, "add a tiny model for the new family"
    config = ditops.BlockSparseConfig(sparsity=0.5)
    for family in FAMILIES:
        model = models[family.name]
        assert family.recognise(model)
        assert not family.model_classes or type(model).__name__ in family.model_classes
        if family.sparse_attention:
            ditops.patch(model, attention=config)
            ditops.unpatch(model)
        else:
            with pytest.raises(PatchError, match="sparse attention"):
                ditops.patch(model, attention=config)


def test_knobs_are_read_in_config_only() -> None:
    """Every DITOPS_* variable is read in ditops/config.py, so the knobs table is whole."""
    reads = re.compile(r"(?:environ(?:\.get)?\s*[\[(]|getenv\()\s*[\"'](DITOPS_\w+)")
    elsewhere = [
        f"{path.relative_to(ROOT)} reads {name}"
        for path in (ROOT / "src" / "ditops").rglob("*.py")
        if path.name != "config.py"
        for name in reads.findall(path.read_text())
    ]
    assert not elsewhere, "read knobs in ditops/config.py and document them there: " + str(
        elsewhere
    )
    assert {v for v, _ in docs_tables.knobs()} >= {"DITOPS_CUSTOM_OPS", "DITOPS_STRICT"}


def test_every_public_name_is_in_the_api_reference() -> None:
    page = (DOCS / "api.md").read_text()
    shown = set(re.findall(r"^::: ditops\.(\w+)$", page, flags=re.M))
    missing = sorted(set(ditops.__all__) - shown)
    assert not missing, f"add `::: ditops.NAME` to docs/api.md for {missing}"


#: The README opens with these, unchanged: the main job, then the tests.
MAIN_JOB = "pip install torch==2.13.0 && pip install -e '.[bench]' && ditops bench"
TESTS = "pip install torch==2.13.0 && pip install -e '.[test]' && python -m pytest -q"


def test_readme_is_a_front_page() -> None:
    readme = (ROOT / "README.md").read_text()
    assert readme.startswith(f"# ditops\n\n```bash\n{MAIN_JOB}\n```\n```bash\n{TESTS}\n```\n")
    lines = len(readme.splitlines())
    assert lines <= 250, f"README.md has {lines} lines: move details into docs/"
    assert len(readme) <= 16_000, f"README.md has {len(readme)} characters: move details"
    for page in re.findall(r"\]\((docs/[\w/-]+\.md)", readme):
        assert (ROOT / page).exists(), f"README.md links to {page}, which does not exist"


@pytest.mark.parametrize("page", docs_tables.pages(ROOT), ids=lambda p: p.name)
def test_page_snippets_are_current(page: Path) -> None:
    """Lists of models and device kinds and the headline figures, wherever a page has
    their markers, are what the declarations and ``benchmarks/`` say now."""
    text = page.read_text()
    assert text == docs_tables.with_snippets(text), f"{page.name} is stale: {REGENERATE}"


def test_the_plot_is_current() -> None:
    svg = (ROOT / docs_tables.SVG).read_text()
    assert svg == docs_figures.svg(ROOT), f"{docs_tables.SVG} is stale: {REGENERATE}"


def test_the_front_pages_list_models_and_figures_from_the_code() -> None:
    readme, index = (ROOT / "README.md").read_text(), (DOCS / "index.md").read_text()
    for name in ("models", "figures", "sparse-devices"):
        assert f"<!-- {name}:begin -->" in readme
    for name in ("models", "device-paths", "results"):
        assert f"<!-- {name}:begin -->" in index
    for name in ("sparse-models",):
        assert f"<!-- {name}:begin -->" in (DOCS / "sparse-attention.md").read_text()
        assert f"<!-- {name}:begin -->" in (DOCS / "usage.md").read_text()


def test_every_declared_family_has_a_name_for_people() -> None:
    declared = {f.name for f in FAMILIES if f.name != "generic"}
    assert set(docs_tables.MODEL_NAMES) == declared, "name the new family in MODEL_NAMES"


def test_every_family_has_a_row_in_what_each_model_gets() -> None:
    """The hand-written table of docs/families.md (what is fused, what runs sparse, what
    diffusers keeps) has a row naming each declared class."""
    page = (DOCS / "families.md").read_text()
    section = page[page.index("## What each model gets") : page.index("## The Wan-derived")]
    missing = [c for f in FAMILIES for c in f.model_classes if f"`{c}`" not in section]
    assert not missing, f"docs/families.md's 'What each model gets' lacks {missing}"


def test_no_docstring_or_message_lists_families_by_hand() -> None:
    """``patch``'s docstring points at the declarations instead of naming families, and
    the refusal of sparse attention names exactly the declared classes."""
    from ditops.integrations.shared.base import SPARSE_MODELS

    doc = ditops.patch.__doc__ or ""
    named = [n for n in ("Wan", "FLUX", "Hunyuan", "CogVideoX", "LTX", "Mochi") if n in doc]
    assert not named, f"patch's docstring names families by hand: {named}"
    declared = [c for f in FAMILIES if f.sparse_attention for c in f.model_classes]
    assert declared == SPARSE_MODELS


#: How the pages name each device kind (a new kind fails here until it is named).
DEVICE_NAMES = {"cpu": "CPU", "cuda": "CUDA", "hip": "ROCm", "xpu": "XPU", "npu": "NPU",
                "mps": "mps"}  # fmt: skip


def test_the_readme_devices_section_names_every_device_kind() -> None:
    from ditops.platform import DEVICE_KINDS

    assert set(DEVICE_NAMES) == set(DEVICE_KINDS)
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Devices") : readme.index("## Figures")]
    missing = [k for k, name in DEVICE_NAMES.items() if name not in section]
    assert not missing, f"README.md's Devices section does not name {missing}"


@pytest.mark.parametrize("page", docs_tables.pages(ROOT), ids=lambda p: p.name)
def test_inline_snippets_stay_inside_their_paragraph(page: Path) -> None:
    """A line that opens with an HTML comment starts an HTML block in markdown, which cuts
    the sentence around an inline list in two: its marker must follow text on its line."""
    inline = [n for n in docs_tables.snippets() if n not in docs_tables.BLOCK_SNIPPETS]
    starts = [n for n in inline if re.search(rf"^<!-- {n}:begin -->", page.read_text(), re.M)]
    assert not starts, f"{page.name}: put the {starts} marker after text on its line"
