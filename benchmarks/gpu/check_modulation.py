"""GPU check of the modulation ops' cuda path (Triton) through the dispatcher.

    OUT=dir python benchmarks/gpu/check_modulation.py

1. correctness on real CUDA tensors vs forward_native on the same device;
2. bandwidth at Wan shapes: eager, ditops fast, byte-matched clone (+ compile once).
"""

# ruff: noqa: B023 - every lambda is timed inside the loop iteration that made it
import json
import os
import sys
import time

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "src"))
import torch
import torch.nn.functional as F
from tests.precision import ulp_distance

import ditops
from ditops import config
from ditops.ops.modulation_fp32 import gated_residual as gr
from ditops.ops.modulation_fp32 import layer_norm_scale_shift as lss
from ditops.ops.modulation_fp32 import scale_residual_layer_norm_scale_shift as fused

CPU = not torch.cuda.is_available()
dev = "cpu" if CPU else "cuda"
res = {"torch": torch.__version__}
if not CPU:
    import triton

    res["gpu"] = torch.cuda.get_device_name()
    res["triton"] = triton.__version__
print(res, flush=True)
force = ditops.force_device_kind({"cpu": "cuda"}) if CPU else None
if force:
    force.__enter__()
g = torch.Generator(device="cpu").manual_seed(0)


def rnd(*s, dt=torch.float32, sc=0.5):
    return (torch.randn(*s, generator=g) * sc).to(dev, dt)


def stats(out, ref):
    d = ulp_distance(out, ref)
    a = (out.float() - ref.float()).abs()
    bad = (d > 1) & (a > 1e-5)
    return {
        "frac_diff": float((d > 0).float().mean()),
        "max_ulp": int(d.max()),
        "n_beyond_tol": int(bad.sum()),
    }


B, L, C, FR = (2, 64, 256, 4) if CPU else (2, 4096, 3072, 16)
checks = {}
with torch.no_grad(), config.override(strict=True):
    for act in (torch.bfloat16, torch.float16):
        for mdt in (torch.float32, act):
            for kind, shp in {
                "batch": (B, 1, C),
                "token": (B, L, C),
                "frame": (B, FR, 1, C),
                "vector": (C,),
            }.items():
                h, a = rnd(B, L, C, dt=act, sc=2), rnd(B, L, C, dt=act)
                w, b = rnd(C) + 1, rnd(C)
                gt, s, t = rnd(*shp, dt=mdt), rnd(*shp, dt=mdt), rnd(*shp, dt=mdt)
                key = f"{str(act)[6:]}-{str(mdt)[6:]}-{kind}"
                args = (h, a, gt, w, b, s, t, 1e-6, None)
                chosen = fused.op.explain_call(*args).chosen
                o, nr = fused(*args[:-1])
                ro, rnr = fused.op.forward_native(*args)
                lo = lss(h, w, b, s, t, 1e-6)
                rlo = lss.op.forward_native(h, w, b, s, t, 1e-6, None)
                go = gr(h, a, gt)
                with config.override(precision="exact"):
                    eo, enr = fused(*args[:-1])
                    echosen = fused.op.explain_call(*args).chosen
                checks[key] = {
                    "chosen": chosen,
                    "exact_chosen": echosen,
                    "gated_bitwise": bool(torch.equal(nr, rnr) and torch.equal(go, rnr)),
                    "exact_bitwise": bool(torch.equal(eo, ro) and torch.equal(enr, rnr)),
                    "fused_norm": stats(o, ro),
                    "ln_norm": stats(lo, rlo),
                }
                print(key, checks[key], flush=True)
res["checks"] = checks


def bench(fn):
    if CPU:
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=60)


EPS = 1e-6


def eager_ln(h, s, t):
    return (F.layer_norm(h.float(), (h.shape[-1],), None, None, EPS) * (1 + s) + t).type_as(h)


def eager_fused(h, a, gt, s, t):
    h = (h.float() + a * gt).type_as(h)
    return eager_ln(h, s, t), h


rows = []
shapes = [(64, 256)] if CPU else [(L_, C_) for L_ in (8192, 32760) for C_ in (1536, 3072, 5120)]
with torch.inference_mode():
    for L_, C_ in shapes:
        for per in ("sample", "token"):
            mr = 1 if per == "sample" else L_
            h, a = rnd(1, L_, C_, dt=torch.bfloat16), rnd(1, L_, C_, dt=torch.bfloat16)
            s, t, gt = rnd(1, mr, C_, sc=0.1), rnd(1, mr, C_, sc=0.1), rnd(1, mr, C_, sc=0.1)
            act = h.numel() * 2
            mod = 0 if per == "sample" else s.numel() * 4
            for op in ("ln_mod", "fused"):
                moved = (2 * act + 2 * mod) if op == "ln_mod" else (4 * act + 3 * mod)
                roof = torch.ones(moved // 2, dtype=torch.uint8, device=dev)
                if op == "ln_mod":
                    v = {
                        "eager": lambda: eager_ln(h, s, t),
                        "fast": lambda: lss(h, None, None, s, t, EPS),
                    }
                else:
                    v = {
                        "eager": lambda: eager_fused(h, a, gt, s, t),
                        "fast": lambda: fused(h, a, gt, None, None, s, t, EPS),
                    }
                v["clone"] = roof.clone
                ms = {k: bench(f) for k, f in v.items()}
                row = {
                    "op": op,
                    "L": L_,
                    "C": C_,
                    "mod": per,
                    **{k + "_ms": round(x, 4) for k, x in ms.items()},
                    "fast_GBps": round(moved / ms["fast"] / 1e6, 1),
                    "clone_GBps": round(moved / ms["clone"] / 1e6, 1),
                    "fast_of_clone": round(ms["clone"] / ms["fast"], 3),
                    "fast_x_eager": round(ms["eager"] / ms["fast"], 2),
                }
                rows.append(row)
                print(row, flush=True)
                del roof
    if not CPU:
        L_, C_ = 8192, 5120
        h = rnd(1, L_, C_, dt=torch.bfloat16)
        s, t = rnd(1, 1, C_, sc=0.1), rnd(1, 1, C_, sc=0.1)
        comp = torch.compile(eager_ln, dynamic=False)
        t0 = time.time()
        comp(h, s, t)
        ct = time.time() - t0
        res["compile_8192x5120"] = {
            "compile_ms": bench(lambda: comp(h, s, t)),
            "fast_ms": bench(lambda: lss(h, None, None, s, t, EPS)),
            "eager_ms": bench(lambda: eager_ln(h, s, t)),
            "compile_time_s": ct,
        }
        print(res["compile_8192x5120"], flush=True)
res["bandwidth"] = rows
out = os.environ.get("OUT", "/tmp")
json.dump(res, open(os.path.join(out, "modulation_gpu.json"), "w"), indent=1)
print("done")
