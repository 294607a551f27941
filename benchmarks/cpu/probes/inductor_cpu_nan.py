"""Repro of the known issue "torch.compile with inductor on CPU" (README, Known issues).

Compiles a tiny patched Wan (bf16, fp32 norms, exact fused blocks) with inductor and with
aot_eager, and with inductor at ``cpp.simdlen = 1``; prints whether each output has NaN
and how far it is from eager. Run from the repository root:

    python benchmarks/cpu/probes/inductor_cpu_nan.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.integrations import test_diffusers_wan as wan_t

import ditops


def main() -> None:
    print(f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}")
    for label, backend, simdlen in (
        ("inductor", "inductor", None),
        ("inductor simdlen=1", "inductor", 1),
        ("aot_eager", "aot_eager", None),
    ):
        torch._dynamo.reset()
        model = wan_t.tiny_wan(keep_fp32=True)
        x = wan_t.inputs(frames=4, hw=16)
        ditops.patch(model, precision="exact")
        want = wan_t.run(model, **x)
        with torch._inductor.config.patch({"cpp.simdlen": simdlen}):
            got = wan_t.run(torch.compile(model, backend=backend), **x)
        diff = (got.float() - want.float()).abs().max().item()
        print(f"{label:20} NaN: {bool(torch.isnan(got).any())}  max |compiled - eager|: {diff:.3g}")


if __name__ == "__main__":
    main()
