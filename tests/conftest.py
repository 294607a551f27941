"""Test-wide set-up.

Triton reads TRITON_INTERPRET when it is first imported, so it is set here, before any
test module can import it: on a machine without a GPU the Triton kernels then run on CPU
tensors through Triton's interpreter (slowly; tests keep their shapes small).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
