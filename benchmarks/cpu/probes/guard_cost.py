"""What the ecosystem guard costs per call: ``Bypass.problem`` for a patched Wan block
(its norms) and for the attention prologue (q/k norms), in microseconds.

    python benchmarks/cpu/probes/guard_cost.py
"""

from __future__ import annotations

import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.integrations import test_diffusers_wan as wan_t

import ditops
from ditops.integrations.wan.attention import PROLOGUE_BYPASS

model = wan_t.tiny_wan(keep_fp32=True)
ditops.patch(model, precision="exact")
block, bypass = model._ditops_patch.targets["blocks.0"]
n = 20000
per_block = timeit.timeit(lambda: bypass.problem(block), number=n) / n
per_attn = timeit.timeit(lambda: PROLOGUE_BYPASS.problem(block.attn1), number=n) / n
print(f"Bypass.problem per Wan block call: {per_block * 1e6:.2f} us (norms), "
      f"{per_attn * 1e6:.2f} us (attention prologue)")  # fmt: skip
