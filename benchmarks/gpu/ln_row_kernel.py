"""A/B of the Triton LayerNorm's 1-D row kernel against its 2-D tile kernel, on a GPU.

    python benchmarks/gpu/ln_row_kernel.py OUT_DIR

Bandwidth as a fraction of a clone of the same tensor (do_bench medians), and the
precision of the row kernel against the meaning on the same device.
"""

from __future__ import annotations

# ruff: noqa: B023 - every lambda is timed inside the loop iteration that made it
import json
import os
import sys

sys.path.insert(0, os.path.join(os.getcwd(), "src"))
sys.path.insert(0, os.getcwd())
import torch
import torch.nn.functional as F
import triton.testing
from tests.precision import ulp_distance

from ditops.kernels.triton import layer_norm as tln


def bench(fn):
    return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))


def main() -> None:
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    res: dict = {"speed": [], "precision": {}}
    for rows in (4096, 8192, 16384, 32760):
        for c in (1536, 3072, 5120):
            x = torch.randn(rows, c, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(c, device="cuda")
            b = torch.randn(c, device="cuda")
            y = torch.empty_like(x)
            r = {"rows": rows, "C": c, "clone_ms": bench(lambda: x.clone())}
            for flag in (True, False):
                tln.ROW_KERNEL = flag
                r["row_ms" if flag else "tile_ms"] = bench(
                    lambda: tln.launch_layer_norm(x, y, w, b, 1e-6)
                )
            tln.ROW_KERNEL = True
            r["op_ms"] = bench(lambda: tln.fp32_layer_norm(x, w, b, 1e-6))
            r["row_of_clone"] = r["clone_ms"] / r["row_ms"]
            r["tile_of_clone"] = r["clone_ms"] / r["tile_ms"]
            r["op_of_clone"] = r["clone_ms"] / r["op_ms"]
            res["speed"].append(r)
            print({k: round(v, 3) for k, v in r.items()}, flush=True)
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        x = (torch.randn(4096, 5200, device="cuda") * 3 + 1).to(dt)[:, 40:5160]
        w, b = torch.randn(5120, device="cuda"), torch.randn(5120, device="cuda")
        out = tln.fp32_layer_norm(x, w, b, 1e-6)
        ref = F.layer_norm(x.float(), (5120,), w, b, 1e-6).to(dt)
        d = ulp_distance(out, ref)
        a = (out.float() - ref.float()).abs()
        res["precision"][str(dt)] = {
            "frac_diff": float((d > 0).float().mean()),
            "beyond_1ulp_and_1e-5": int(((d > 1) & (a > 1e-5)).sum()),
            "max_abs": float(a.max()),
        }
    print(res["precision"], flush=True)
    with open(os.path.join(out_dir, "ln_row_kernel.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
