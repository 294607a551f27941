"""Griffe extension: the API pages show each public op's docstring as ``help()`` does.

``ditops.core.public.public_op`` appends a "Paths" section, written from the op's
declared paths, to each public op's docstring at import; griffe reads the source, which
lacks it. This imports ditops (from ``src/`` when it is not installed) and gives each
public op's page entry its docstring as ``help()`` shows it, with two changes for the
page: reST's ``Meaning::`` reads ``Meaning:``, and the entries of an indented section
("Shapes and dtypes:") become a list, one entry a line as in ``help()``.

``ditops.patch``'s options default to a sentinel (``UNSET``: keep what an earlier patch
set); its page shows the value a first patch takes instead, read from ``PatchOptions``.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import sys
from pathlib import Path

import griffe


def _ditops():
    try:
        return importlib.import_module("ditops")
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
        return importlib.import_module("ditops")


#: Sections whose indented entries read as a list (Google sections, "Args:", are parsed).
LISTED = ("Shapes and dtypes:",)


def _for_the_page(doc: str) -> str:
    lines = []
    section = False
    for line in doc.splitlines():
        body = line.strip()
        if line.startswith("        ") and section:
            lines.append("      " + body)  # an entry's continuation
        elif line.startswith("    ") and section:
            lines.append("    - " + body)  # an entry of the section
        else:
            section = body in LISTED
            lines.append(line[:-1] if line.endswith("::") else line)
    return "\n".join(lines)


class PublicOpDocstrings(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs: object) -> None:
        if pkg.name != "ditops":
            return
        ditops = _ditops()
        for name in ditops.__all__:
            fn = getattr(ditops, name)
            if inspect.isfunction(fn) and hasattr(fn, "op") and fn.__doc__:
                target = pkg[name].final_target
                text = _for_the_page(inspect.cleandoc(fn.__doc__))
                target.docstring = griffe.Docstring(text, parent=target)


class PatchDefaults(griffe.Extension):
    """``patch(norms=UNSET, ...)`` reads ``patch(norms=True, ...)`` on the page."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: object) -> None:
        if pkg.name != "ditops":
            return
        _ditops()
        from ditops.integrations.shared.base import PatchOptions

        defaults = {f.name: f.default for f in dataclasses.fields(PatchOptions)}
        target = pkg["patch"].final_target
        for param in target.parameters:
            if str(param.default) == "UNSET" and param.name in defaults:
                param.default = repr(defaults[param.name])
