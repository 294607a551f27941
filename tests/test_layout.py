"""The house's layout rules, checked on the source (architecture.md, "Suggested layout").

* Nothing inside the package imports its face (``import ditops`` / ``from ditops import
  <public name>``): the face is the top of the house, built from the parts below it.
* ``kernels/`` imports nothing from ``layers/`` or ``integrations/``; ``layers/`` nothing
  from ``integrations/`` or ``bench/``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "ditops"
MODULES = sorted(p for p in SRC.rglob("*.py") if p.name != "__init__.py" or p.parent != SRC)
SUBPACKAGES = {p.name for p in SRC.iterdir() if p.is_dir()} | {
    p.stem for p in SRC.glob("*.py") if p.name != "__init__.py"
}


def imported(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) for every import statement in ``path`` (all levels)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.extend((a.name, []) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, [a.name for a in node.names]))
    return found


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SRC)))
def test_no_module_imports_the_package_face(path: Path) -> None:
    for module, names in imported(path):
        assert module != "ditops" or all(n in SUBPACKAGES for n in names), (
            f"{path.relative_to(SRC)} imports the face: {module} {names}; import the part"
        )


@pytest.mark.parametrize(
    ("folder", "forbidden"),
    [("kernels", ("ditops.layers", "ditops.integrations", "ditops.bench")),
     ("layers", ("ditops.integrations", "ditops.bench")),
     ("attention", ("ditops.layers", "ditops.integrations", "ditops.bench"))],
)  # fmt: skip
def test_lower_folders_do_not_import_higher_ones(folder: str, forbidden: tuple[str, ...]) -> None:
    for path in (SRC / folder).rglob("*.py"):
        for module, _ in imported(path):
            assert not module.startswith(forbidden), (
                f"{path.relative_to(SRC)} imports {module}: {folder}/ sits below it"
            )
