"""Triton: the kernels behind the ``cuda``, ``hip`` and ``xpu`` fast paths.

``import triton`` happens on the first probe, not at ``import ditops``. Kernels live in
:mod:`ditops.kernels.triton` and are imported only after this probe succeeded. With
``TRITON_INTERPRET=1`` (set before Triton is imported) the same kernels run on CPU
tensors through Triton's interpreter: that is how the tests run them without a GPU.
"""

from __future__ import annotations

import importlib
import os

from ditops.backends.base import Backend


class TritonBackend(Backend):
    name = "triton"
    install_hint = "pip install 'ditops[triton]' (or: pip install triton)"

    def _probe(self) -> list[str]:
        try:
            triton = importlib.import_module("triton")
            importlib.import_module("triton.language")
        except ImportError as exc:
            return [f"triton is not installed ({exc.msg}); {self.install_hint}"]
        if not hasattr(triton, "jit"):
            return [
                f"the installed 'triton' ({getattr(triton, '__file__', '?')}) has no triton.jit"
            ]
        return []

    @staticmethod
    def interpreting() -> bool:
        """True when Triton kernels run through the CPU interpreter (TRITON_INTERPRET=1)."""
        return os.environ.get("TRITON_INTERPRET", "0") == "1"


TRITON = TritonBackend()
