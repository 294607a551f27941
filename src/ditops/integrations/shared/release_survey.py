"""The fingerprints of the installed diffusers' relied-on functions, as the table
(:data:`~ditops.integrations.shared.fingerprints.KNOWN`) is made from: a maintainer's tool.

``python -m ditops.integrations.shared.release_survey`` prints ``{"version": ...,
"fingerprints": {label: {fingerprint: [site, ...]}}}`` as JSON; run it once per release
(``PYTHONPATH=src:/work/overlays/diffusers-X``) and compare with the table, or let
``tests/integrations/test_release_fingerprints.py`` do it for the installed release.
"""

from __future__ import annotations

import importlib
import json
import sys
from typing import Any

from ditops.integrations.shared.fingerprint_sites import SITES
from ditops.integrations.shared.fingerprints import fingerprint


def locate(module: str, qualname: str) -> Any:
    """The function at ``module:qualname`` in the installed diffusers, or None."""
    try:
        obj: Any = importlib.import_module(module)
    except ImportError:
        return None
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def survey(prune: bool = True) -> dict[str, dict[str, list[str]]]:
    """label -> fingerprint -> the sites (``module:qualname``) that have it."""
    out: dict[str, dict[str, list[str]]] = {}
    for label, sites in SITES.items():
        for module, qualname in sites:
            fn = locate(module, qualname)
            if fn is not None:
                site = f"{module.rsplit('.', 1)[-1]}:{qualname}"
                out.setdefault(label, {}).setdefault(fingerprint(fn, prune), []).append(site)
    return out


def main() -> None:
    import diffusers

    json.dump(
        {
            "version": diffusers.__version__,
            "fingerprints": survey(),
            "unpruned": survey(prune=False),
        },
        sys.stdout,
        indent=1,
        sort_keys=True,
    )


if __name__ == "__main__":
    main()
