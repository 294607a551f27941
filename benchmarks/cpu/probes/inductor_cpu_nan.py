"""Repro of the known issue "torch.compile with inductor on CPU" (README, Known issues).

Compiles a tiny patched Wan (bf16, fp32 norms, fused blocks) with inductor and with
aot_eager, and with inductor at ``cpp.simdlen = 1``; prints whether each output has NaN
and how far it is from eager. Issue 25 added fast precision and sparse attention (the
other kernels in the graph) and prints the CPU's AMX answer. Run from the repository root:

    python benchmarks/cpu/probes/inductor_cpu_nan.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.integrations import test_diffusers_wan as wan_t

import ditops
from ditops.attention import BlockSparseConfig
from ditops.backends.inductor_cpu import amx_tiles

SPARSE = BlockSparseConfig(sparsity=0.5, skip_first_steps=0, block_size=32, stride=4)
CASES = (
    ("exact, inductor", "inductor", None, {"precision": "exact"}),
    ("exact, inductor simdlen=1", "inductor", 1, {"precision": "exact"}),
    ("exact, aot_eager", "aot_eager", None, {"precision": "exact"}),
    ("fast, inductor", "inductor", None, {"precision": "fast"}),
    ("fast + sparse, inductor", "inductor", None, {"precision": "fast", "attention": SPARSE}),
)


def main() -> None:
    print(
        f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, "
        f"AMX tiles {amx_tiles()}, load {os.getloadavg()[0]:.1f}"
    )
    for label, backend, simdlen, options in CASES:
        torch._dynamo.reset()
        model = wan_t.tiny_wan(keep_fp32=True)
        x = wan_t.inputs(frames=8, hw=16)  # 512 tokens: scored sparse blocks
        ditops.patch(model, **options)
        want = wan_t.run(model, step=1, **x)
        with torch._inductor.config.patch({"cpp.simdlen": simdlen}):
            got = wan_t.run(torch.compile(model, backend=backend), step=1, **x)
        diff = (got.float() - want.float()).abs().max().item()
        print(f"{label:28} NaN: {bool(torch.isnan(got).any())}  max |compiled - eager|: {diff:.3g}")


if __name__ == "__main__":
    main()
