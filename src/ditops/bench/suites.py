"""The benchmark suites ``ditops bench`` can run, by name (:class:`~ditops.bench.suite.Suite`).

:data:`SUITES` names the module of each suite; a suite's module is imported when the
suite is first asked for (:func:`get_suite`), so naming one suite imports that one only.
The model suites (``wan``, ``flux``, ``hunyuan_video``) are not suites of cases: the CLI
runs them itself.
"""

from __future__ import annotations

import importlib

from ditops.bench.suite import Suite

SIZES = ("small", "full")

#: suite name -> the module that defines it as ``SUITE``
SUITES: dict[str, str] = {
    "layer_norm": "ditops.bench.layer_norm",
    "modulation": "ditops.bench.modulation",
    "attention": "ditops.bench.attention",
    "masks": "ditops.bench.masks",
    "qk_norm_rope": "ditops.bench.qk_norm_rope",
}


def get_suite(name: str) -> Suite:
    """Suite ``name`` (a key of :data:`SUITES`), its module imported on first call."""
    suite: Suite = importlib.import_module(SUITES[name]).SUITE
    if suite.name != name:
        raise ValueError(f"{SUITES[name]}.SUITE is named {suite.name!r}, listed as {name!r}")
    return suite
