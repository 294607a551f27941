"""The sglang tests run in sglang's own environment (``.ci/sglang`` builds it from the
pinned wheels); the main environment has no sglang and must not collect them.

That is an environment split, not a convenience skip: where sglang is absent this folder
is ignored at collection (``collect_ignore_glob``), and ``.ci/sglang`` runs it where
sglang is present. There, ``_site/sitecustomize.py`` is put on ``PYTHONPATH`` so that this
process and every worker process sglang spawns load it first (the torchvision schema
shim it documents).
"""

from __future__ import annotations

import importlib.util
import os
import runpy
from pathlib import Path

if importlib.util.find_spec("sglang") is None:
    collect_ignore_glob = ["*.py"]
else:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # every checkpoint is written locally
    _SITE = str(Path(__file__).parent / "_site")
    if _SITE not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (_SITE, os.environ.get("PYTHONPATH", "")) if p
        )
    # This process started before PYTHONPATH had it: run the shim here too (kept alive).
    _shim = runpy.run_path(str(Path(_SITE) / "sitecustomize.py"))
