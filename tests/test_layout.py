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
    [
        ("kernels", ("ditops.layers", "ditops.integrations", "ditops.bench")),
        ("layers", ("ditops.integrations", "ditops.bench")),
        ("attention", ("ditops.layers", "ditops.integrations", "ditops.bench")),
    ],
)
def test_lower_folders_do_not_import_higher_ones(folder: str, forbidden: tuple[str, ...]) -> None:
    for path in (SRC / folder).rglob("*.py"):
        for module, _ in imported(path):
            assert not module.startswith(forbidden), (
                f"{path.relative_to(SRC)} imports {module}: {folder}/ sits below it"
            )


# --- the op core's layout (issue 17): who may import whom, and what may cross a module ----

#: folder -> the ditops folders its modules must not import.
FORBIDDEN = {
    "core": ("ops", "layers", "kernels", "attention", "integrations", "bench"),
    "backends": ("core", "ops", "layers", "kernels", "attention", "integrations", "bench"),
    "kernels": ("core", "ops", "layers", "integrations", "bench", "platform"),
    "attention": ("ops", "layers", "integrations", "bench"),
    "ops": ("layers", "integrations", "bench"),
    "layers": ("kernels", "integrations", "bench"),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


ALL = {module_name(p): p for p in SRC.rglob("*.py")}


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_folder_imports_follow_the_layout(folder: str) -> None:
    banned = tuple(f"ditops.{f}" for f in FORBIDDEN[folder])
    for path in (SRC / folder).rglob("*.py"):
        for module, _ in imported(path):
            assert not (module.startswith(banned) and module.split(".")[1] in FORBIDDEN[folder]), (
                f"{path.relative_to(SRC)} imports {module}; {folder}/ must not import "
                f"{', '.join(FORBIDDEN[folder])}"
            )


def test_no_private_name_is_imported_from_another_module() -> None:
    crossings = []
    for name, path in ALL.items():
        for module, names in imported(path):
            if not module.startswith("ditops") or module == name:
                continue
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private:
                crossings.append(f"{name} imports {', '.join(private)} from {module}")
    assert not crossings, "\n".join(crossings)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _assigned(stmt: ast.stmt) -> set[str]:
    """The plain names a statement assigns (``x = ...``, ``x: T = ...``)."""
    targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
    return {t.id for t in targets if isinstance(t, ast.Name)}


class _Reach(ast.NodeVisitor):
    """The private attributes a module defines (at its top level, in its class bodies, and
    as ``self._x``/``cls._x`` in its methods) and those it reaches (``x._name``, where
    ``x`` is not the method's own ``self``/``cls``)."""

    def __init__(self) -> None:
        self.defines: set[str] = set()
        self.reaches: list[tuple[int, str]] = []
        self.own: list[str | None] = [None]  # the enclosing method's self/cls

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.defines.add(node.name)
        for item in node.body:
            self.defines |= _assigned(item)
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and item.args.args:
                self.defines.add(item.name)
                self.own.append(item.args.args[0].arg)
                for stmt in item.body:
                    self.visit(stmt)
                self.own.pop()
            else:
                self.visit(item)

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.defines.add(node.name)
        self.own.append(None)  # a nested function's names are not a method's own
        self.generic_visit(node)
        self.own.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if _private(node.attr):
            own = isinstance(node.value, ast.Name) and node.value.id == self.own[-1]
            if own and isinstance(node.ctx, ast.Store):
                self.defines.add(node.attr)
            elif not own:
                self.reaches.append((node.lineno, node.attr))
        self.generic_visit(node)


def reach(path: Path) -> _Reach:
    tree = ast.parse(path.read_text())
    found = _Reach()
    for node in tree.body:
        found.defines |= _assigned(node)
        found.visit(node)
    found.defines = {n for n in found.defines if _private(n)}
    return found


#: Private names of diffusers that a ditops module also defines (a fingerprint names
#: ``QwenImageTransformerBlock._modulate``): not ditops' own reach.
THEIRS = {"_modulate"}


def test_no_private_attribute_is_reached_across_modules() -> None:
    """``x._name`` (read or written) where ``_name`` is private to another ditops module:
    a seam, not a reach-in. A method's own ``self._x``/``cls._x`` is not counted (a
    subclass may use its base's), nor are other packages' privates (``torch._C``)."""
    found = {name: reach(path) for name, path in ALL.items()}
    ours = set().union(*(f.defines for f in found.values())) - THEIRS
    crossings = [
        f"{name}:{line} reaches .{attr}"
        for name, f in found.items()
        for line, attr in f.reaches
        if attr in ours and attr not in f.defines
    ]
    assert not crossings, "\n".join(crossings)


def test_no_import_cycle() -> None:
    """Every import counts, late ones (inside functions) and type-only ones too: a cycle
    hidden in a function or under ``TYPE_CHECKING`` is still a cycle to a reader."""
    graph: dict[str, set[str]] = {name: set() for name in ALL}
    for name, path in ALL.items():
        for module, names in imported(path):
            targets = {f"{module}.{n}" for n in names if f"{module}.{n}" in ALL}
            if not targets and module in ALL:
                targets = {module}
            graph[name] |= {t for t in targets if t != name and not name.startswith(t + ".")}
    # Tarjan's strongly connected components.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


#: A file a reader takes in at one sitting; the op core's budget (issue 17).
MAX_LINES = 450


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SRC)))
def test_no_file_is_too_long(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(SRC)} has {lines} lines (at most {MAX_LINES})"


#: A model family's own code beyond its fused forwards' arithmetic (issue 27): its
#: declaration and checks, in ``integrations/<family>/family.py``.
MAX_FAMILY_LINES = 250
FAMILY_FILES = sorted(
    p for p in (SRC / "integrations").glob("*/family.py") if p.parent.name != "shared"
)


def test_every_family_is_declared_in_its_own_folder_within_budget() -> None:
    """Each family folder declares a ``SPEC`` in ``family.py`` of at most 250 lines, and
    every family ditops patches with is such a declaration (the generic one aside)."""
    from ditops.integrations.patching import FAMILIES
    from ditops.integrations.shared.family import DeclaredFamily

    assert FAMILY_FILES, "no integrations/<family>/family.py"
    for path in FAMILY_FILES:
        lines = len(path.read_text().splitlines())
        assert lines <= MAX_FAMILY_LINES, f"{path.relative_to(SRC)} has {lines} lines"
        assert "\nSPEC = FamilySpec(" in path.read_text(), f"{path.relative_to(SRC)}: no SPEC"
    declared = [f for f in FAMILIES if f.name != "generic"]
    assert all(isinstance(f, DeclaredFamily) for f in declared), declared
    assert len({f.name for f in FAMILIES}) == len(FAMILIES)


#: The family whose code a family extends (its blocks are copies of the parent's): the one
#: other family folder it may import. Every other family imports ``shared/`` only.
FAMILY_PARENTS = {"chroma": "flux", "flux2": "flux", "ltx2": "ltx_video"}


def test_a_family_imports_shared_and_at_most_its_declared_parent() -> None:
    families = {p.parent.name for p in FAMILY_FILES}
    assert set(FAMILY_PARENTS) <= families and set(FAMILY_PARENTS.values()) <= families
    reaches = []
    for family in sorted(families):
        allowed = {family, "shared", FAMILY_PARENTS.get(family)}
        for path in (SRC / "integrations" / family).rglob("*.py"):
            for module, names in imported(path):
                parts = module.split(".")
                if module == "ditops.integrations":
                    used = set(names)
                elif parts[:2] == ["ditops", "integrations"] and len(parts) > 2:
                    used = {parts[2]}
                else:
                    continue
                for other in (used & families) - allowed:
                    reaches.append(f"{path.relative_to(SRC)} imports the family {other}")
    assert not reaches, "\n".join(reaches)
