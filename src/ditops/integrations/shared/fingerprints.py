"""What a family checks each diffusers function it reproduces by: a fingerprint of what the
function computes, not of its text, and the table of the fingerprints ditops knows.

:func:`fingerprint` hashes the function's syntax tree after four normalisations, each of
which leaves the computation as it is:

1. comments and formatting are gone (they are not in the tree);
2. docstrings and every other bare string statement are dropped (a no-op when run), and
   annotations too (they compute nothing in the body);
3. the function's own local variables are renamed by order of first appearance to names
   no source can spell (``$0``, ``$1``...). Only names bound by plain assignment, loop,
   ``with ... as`` or ``:=`` in the function's own scope, and no name bound another way
   (an import, a nested ``def``, ``except ... as``, ``global``): such a renaming is a
   consistent one-to-one change of local names, which Python's scoping makes meaningless.
   Parameters, globals, attributes and keywords keep their names;
4. a branch on a platform probe that is false in this process (``if
   is_torch_npu_available():`` on a host without ``torch_npu``) is replaced by its
   ``else``: the tree the process will run. Where the probe is true, the branch stays and
   the fingerprint is that of the whole function.

Everything else (every operator, constant, eps default, call, argument order, the order
of operations, decorators) is in the tree, so a change of any of them changes the
fingerprint and the family refuses the model naming the function (see
``docs/releases.md``). The serialisation skips empty fields, so the fingerprint of a
function is the same under every Python ast version from 3.10 on.

:data:`~ditops.integrations.shared.fingerprint_table.KNOWN` is the table: function label
-> fingerprint -> :class:`~ditops.integrations.shared.fingerprint_table.Seen` (the releases
whose function has it, and whose arithmetic ditops reproduces for it: the *variant* a
family selects its code by, or None: refused).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import inspect
import textwrap
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ditops.integrations.shared.fingerprint_table import KNOWN, Seen, span

#: Platform probes a branch may be pruned on: name -> (module, attribute) of diffusers'
#: probe, which must be the very function the relied-on code calls.
PROBES: dict[str, tuple[str, str]] = {
    "is_torch_npu_available": ("diffusers.utils", "is_torch_npu_available"),
}

_SKIPPED_FIELDS = frozenset({"type_comment", "type_params", "kind", "ctx"})
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def _stripped(body: list[ast.stmt]) -> list[ast.stmt]:
    """``body`` without bare constant statements (docstrings, ``...``): ``pass`` if empty."""
    kept = [s for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    return kept or [ast.Pass()]


class _Normalise(ast.NodeTransformer):
    """Steps 2 and 4 of the module doc: strings, annotations, false probe branches."""

    def __init__(self, globals_: Mapping[str, Any], prune: bool) -> None:
        self.globals = globals_
        self.prune = prune

    def _false_probe(self, test: ast.expr) -> bool:
        """``test`` is a probe false in this process, or an ``and`` whose first operand is
        one (nothing after it runs)."""
        if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
            return self._false_probe(test.values[0])
        if not (isinstance(test, ast.Call) and isinstance(test.func, ast.Name)):
            return False
        if test.args or test.keywords or test.func.id not in PROBES:
            return False
        import importlib

        module, attr = PROBES[test.func.id]
        try:
            probe = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError):
            return False
        return self.globals.get(test.func.id) is probe and not probe()

    def generic_visit(self, node: ast.AST) -> ast.AST:
        node = super().generic_visit(node)
        for name in ("body", "orelse", "finalbody"):
            value = getattr(node, name, None)
            if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
                kept = _stripped(value)
                setattr(node, name, kept if name == "body" else [s for s in kept if s in value])
        return node

    def visit_If(self, node: ast.If) -> Any:
        if self.prune and self._false_probe(node.test):
            return [self.visit(s) for s in node.orelse] or ast.Pass()
        return self.generic_visit(node)

    def visit_arg(self, node: ast.arg) -> ast.arg:
        node.annotation = None
        return node

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
        node.returns = None
        return self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_AnnAssign(self, node: ast.AnnAssign) -> Any:
        if node.value is None:
            return None  # a declaration computes nothing
        return ast.Assign(targets=[self.visit(node.target)], value=self.visit(node.value))


def _own_scope(node: ast.AST) -> Iterator[ast.AST]:
    """Every node in ``node``'s scope, nested scopes' own bindings left out (their names
    are still yielded where they are read, as closures read the enclosing locals)."""
    for child in ast.iter_child_nodes(node):
        yield child
        if isinstance(child, (*_SCOPES, *_COMPREHENSIONS)):
            continue
        yield from _own_scope(child)


def _locals(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """The names step 3 renames, in order of first appearance."""
    params = {a.arg for a in ast.walk(fn.args) if isinstance(a, ast.arg)}
    renamed: dict[str, None] = {}
    other: set[str] = set()
    for node in _own_scope(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            renamed.setdefault(node.id)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            other.update(node.names)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            other.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            other.add(node.name)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            other.add(node.name)
    for node in ast.walk(fn):  # ``:=`` in a comprehension binds in the function
        if isinstance(node, ast.NamedExpr) and isinstance(node.target, ast.Name):
            renamed.setdefault(node.target.id)
    names = [n for n in renamed if n not in other and n not in params]
    order = {}
    for node in sorted(
        (n for n in ast.walk(fn) if isinstance(n, ast.Name) and n.id in names),
        key=lambda n: (n.lineno, n.col_offset),
    ):
        order.setdefault(node.id, len(order))
    return sorted(names, key=order.__getitem__)


def _serial(node: Any) -> str:
    """A dump of the tree with empty fields skipped (the same on every Python ast)."""
    if isinstance(node, ast.AST):
        parts = []
        for name, value in sorted(ast.iter_fields(node)):
            if name in _SKIPPED_FIELDS or value is None or value == []:
                continue
            parts.append(f"{name}={_serial(value)}")
        return f"{type(node).__name__}({','.join(parts)})"
    if isinstance(node, list):
        return "[" + ",".join(_serial(v) for v in node) + "]"
    return f"{type(node).__name__}:{node!r}"


def computes(fn: Callable[..., Any], prune: bool = True) -> str | None:
    """The normalised tree of ``fn`` (what :func:`fingerprint` hashes), or None when its
    source cannot be read or parsed. ``prune=False`` keeps every probe's branches."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None
    node = tree.body[0] if tree.body else None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    node.name = "$fn"  # the label names the function; a copy under another name is found
    fn_globals = getattr(inspect.unwrap(fn), "__globals__", {})
    node = _Normalise(fn_globals, prune).visit(node)
    mapping = {name: f"${i}" for i, name in enumerate(_locals(node))}
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id in mapping:
            sub.id = mapping[sub.id]
    return _serial(node)


def fingerprint(fn: Callable[..., Any], prune: bool = True) -> str:
    """sha256 (first 16 hex digits) of what ``fn`` computes (:func:`computes`), or
    ``"unavailable"`` when its source cannot be read (then no table holds it)."""
    tree = computes(fn, prune)
    if tree is None:
        return "unavailable"
    return hashlib.sha256(tree.encode()).hexdigest()[:16]


#: label -> (diffusers function, accepted fingerprints): what a family relies on.
Relied = dict[str, tuple[Callable[..., Any], Mapping[str, Seen]]]


def known(label: str) -> Mapping[str, Seen]:
    """The fingerprints of ``label`` the table holds (accepted or refused)."""
    return KNOWN[label]


def relied(module: Any, *names: str, label: str = "{}") -> Relied:
    """What a family relies on in ``module`` (a module, or its dotted path, imported now):
    each dotted ``name`` there (``"RMSNorm.forward"``) with the fingerprints the table holds
    for it, under ``label.format(name)``."""
    if isinstance(module, str):
        module = importlib.import_module(module)
    out: Relied = {}
    for name in names:
        fn = module
        for part in name.split("."):
            fn = getattr(fn, part)
        out[label.format(name)] = (fn, known(label.format(name)))
    return out


def match(fn: Callable[..., Any], table: Mapping[str, Seen]) -> Seen | None:
    """The accepted entry of ``table`` ``fn`` has (its arithmetic is one ditops runs), or
    None."""
    seen = table.get(fingerprint(fn))
    return seen if seen is not None and seen.arithmetic is not None else None


def accepted(table: Mapping[str, Seen]) -> str:
    """The releases of the accepted entries, for messages."""
    runs = tuple(r for s in table.values() if s.arithmetic is not None for r in s.releases)
    return f"diffusers {span(runs)}" if runs else "none"


def differs(
    label: str, fn: Callable[..., Any], table: Mapping[str, Seen], name_release: bool = True
) -> str | None:
    """Why ``fn`` (``label``) is refused, or None when its arithmetic is one ditops runs."""
    fp = fingerprint(fn)
    seen = table.get(fp)
    if seen is not None and seen.arithmetic is not None:
        return None
    why = f" ({seen}: {seen.note})" if seen is not None and seen.note else ""
    of = f" of diffusers {_version()}" if name_release else ""
    return (
        f"{label}{of} (fingerprint {fp}) differs from the versions ditops knows "
        f"({accepted(table)}){why}"
    )


def problems(relied: Relied) -> list[str]:
    """One problem per function in ``relied`` whose fingerprint is not accepted."""
    found = (differs(label, fn, table) for label, (fn, table) in relied.items())
    return [p for p in found if p]


def arithmetic(relied: Relied) -> dict[str, str]:
    """label -> the release whose arithmetic was matched, for every accepted function."""
    out = {}
    for label, (fn, table) in relied.items():
        seen = match(fn, table)
        if seen is not None:
            out[label] = seen.arithmetic  # type: ignore[assignment]
    return out


@functools.lru_cache(maxsize=256)
def arithmetic_of(fn: Callable[..., Any], label: str) -> str | None:
    """The release whose arithmetic ``fn`` (checked under ``label``) was matched to, or
    None: what a processor with variants asks once, when it is built (cached per function)."""
    seen = match(fn, KNOWN[label])
    return None if seen is None else seen.arithmetic


def _version() -> str:
    import diffusers

    return getattr(diffusers, "__version__", "?")
