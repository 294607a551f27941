"""GPU check of the attention-prologue ops' cuda path (Triton) through the dispatcher.

    python3 benchmarks/gpu/qk_norm_rope.py $OUT      (writes $OUT/qk_norm_rope_gpu.json)

1. correctness on real CUDA tensors against forward_native on the same device, strict
   mode (a fallback raises): the fused op within its fast contract (ulps of the output
   dtype at the rotated pair's magnitude, share beyond 1 ulp), the rotation alone
   bitwise, the standalone norm within 1 (2) ulps; exact mode bitwise (native on GPUs);
2. speed at Wan's and FLUX's shapes, bf16: eager (forward_native), torch.compile of it,
   ditops fast (dispatcher, then the kernel itself), a clone of the same bytes; and the
   Triton kernel's tile size (TILE_ELEMENTS) swept, for the lead to pick.

Under two minutes on an H200 (most of it compiling). Without a GPU it runs on CPU
tensors through Triton's interpreter, tiny shapes (a dry run of the script).
"""

# ruff: noqa: B023, E402 - lambdas are timed inside the iteration that made them
import json
import os
import sys
import time

import torch

CPU = not torch.cuda.is_available()
if CPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "src"))

from tests.precision import pair_magnitude, ulp_distance

import ditops
from ditops import config
from ditops.kernels.triton import qk_norm_rope as T
from ditops.ops.qk_norm_rope import qk_norm_rope, rms_norm, rotary_embedding

OUT = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "/tmp")
dev = "cpu" if CPU else "cuda"
EPS = 1e-6
res: dict = {"torch": torch.__version__, "device": "cpu (interpreter)" if CPU else dev}
if not CPU:
    import triton

    res["gpu"] = torch.cuda.get_device_name()
    res["triton"] = triton.__version__
print(res, flush=True)
FORCE = ditops.force_device_kind({"cpu": "cuda"}) if CPU else None
if FORCE is not None:
    FORCE.__enter__()  # kept referenced: collecting it would undo the forcing
g = torch.Generator().manual_seed(0)


def rnd(*s, dt=torch.float32, sc=1.0, sh=0.0):
    return (torch.randn(*s, generator=g) * sc + sh).to(dev, dt)


def rope(L, D):
    a = torch.rand(L, D // 2, generator=g) * 6.28
    return a.cos().to(dev), a.sin().to(dev)


def pair_stats(out, ref, layout):
    """Worst error in ulps of the pair's magnitude, share beyond 1, share differing."""
    if out.dtype == torch.float32:
        err = (out - ref).abs() / pair_magnitude(ref, layout).clamp_min(1e-30)
        return {
            "max_rel_to_pair": float(torch.where(torch.isfinite(ref), err, 0).max()),
            "nan_match": bool(torch.equal(out.isnan(), ref.isnan())),
        }
    mag = pair_magnitude(ref, layout).to(ref.dtype)
    ulp = (torch.nextafter(mag, torch.full_like(mag, float("inf"))) - mag).float()
    e = torch.where(torch.isfinite(ref), (out.float() - ref.float()).abs() / ulp, 0)
    return {
        "max_pair_ulp": round(float(e.max()), 3),
        "frac_beyond_1": float((e > 1).float().mean()),
        "frac_diff": float((out != ref).float().mean()),
        "nan_match": bool(torch.equal(out.isnan(), ref.isnan())),
    }


# --- 1. correctness ------------------------------------------------------------------------
checks = {}
B, L, H, D = (2, 6, 3, 16) if CPU else (2, 1024, 12, 128)
with torch.inference_mode(), config.override(strict=True):
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        for convention in ("torch", "diffusers"):
            for across in (False, True):
                for layout in ("interleaved", "halves"):
                    q, k = rnd(B, L, H, D, dt=dt, sc=2), rnd(B, L, H, D, dt=dt)
                    q[0, 1, 2, 3] = float("nan")
                    n = H * D if across else D
                    w = rnd(n, dt=dt, sc=0.5, sh=1.0)
                    cos, sin = rope(L, D)
                    args = (q, k, w, w, cos, sin, EPS)
                    kw = {"across_heads": across, "layout": layout, "convention": convention}
                    key = f"{str(dt)[6:]}-{convention}-{'across' if across else 'head'}-{layout}"
                    chosen = qk_norm_rope.op.explain_call(*args, **kw).chosen
                    got = qk_norm_rope(*args, **kw)
                    want = qk_norm_rope.op.forward_native(
                        *args, across_heads=across, layout=layout, convention=convention
                    )
                    with config.override(precision="exact"):
                        ex = qk_norm_rope(*args, **kw)
                    x = rnd(B, L, H, D, dt=dt)
                    rot = rotary_embedding(x, cos, sin, layout)
                    rot_ref = rotary_embedding.op.forward_native(x, cos, sin, layout)
                    nx = rnd(B * L, n, dt=dt, sc=3)
                    nrm = rms_norm(nx, w, EPS, convention)
                    nrm_ref = rms_norm.op.forward_native(nx, w, EPS, convention)
                    checks[key] = {
                        "chosen": chosen,
                        "fused_q": pair_stats(got[0], want[0], layout),
                        "fused_k": pair_stats(got[1], want[1], layout),
                        "exact_bitwise": bool(torch.equal(ex[1], want[1])),
                        "rotary_bitwise": bool(torch.equal(rot, rot_ref)),
                        "rms_norm_max_ulp": int(ulp_distance(nrm, nrm_ref).max()),
                        "rms_norm_frac_diff": float((nrm != nrm_ref).float().mean()),
                    }
                    print(key, checks[key], flush=True)
res["checks"] = checks


# --- 2. speed ------------------------------------------------------------------------------
def bench(fn):
    if CPU:
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=50)


def meaning(q, k, wq, wk, cos, sin, across):
    return qk_norm_rope.op.forward_native(q, k, wq, wk, cos, sin, EPS, across_heads=across)


compiled = torch.compile(meaning, dynamic=False)
shapes = (
    [("wan", 32, 3, True), ("flux", 24, 4, False)]
    if CPU
    else [("wan", 8192, 12, True), ("flux", 4608, 24, False), ("wan14b", 8192, 40, True),
          ("wan-720p", 32760, 12, True)]
)  # fmt: skip
rows = []
with torch.inference_mode():
    for name, L_, H_, across in shapes:
        q, k = rnd(1, L_, H_, D, dt=torch.bfloat16), rnd(1, L_, H_, D, dt=torch.bfloat16)
        n = H_ * D if across else D
        wq, wk = rnd(n, dt=torch.bfloat16, sc=0.3, sh=1), rnd(n, dt=torch.bfloat16, sc=0.3, sh=1)
        cos, sin = rope(L_, D)
        moved = 4 * q.numel() * 2
        roof = torch.ones(moved // 2, dtype=torch.uint8, device=dev)
        c3, s3 = cos.unsqueeze(0), sin.unsqueeze(0)
        v = {
            "eager": lambda: meaning(q, k, wq, wk, cos, sin, across),
            "fast": lambda: qk_norm_rope(q, k, wq, wk, cos, sin, EPS, across_heads=across),
            "kernel": lambda: T.qk_norm_rope(
                q, k, wq, wk, c3, s3, EPS, across, "interleaved", "torch"
            ),
            "clone": roof.clone,
        }
        if name in ("wan", "flux"):
            t0 = time.time()
            compiled(q, k, wq, wk, cos, sin, across)
            res[f"compile_time_s_{name}"] = round(time.time() - t0, 1)
            v["compile"] = lambda: compiled(q, k, wq, wk, cos, sin, across)
        ms = {key: bench(f) for key, f in v.items()}
        tiles = {}
        for tile in (2048, 4096, 8192, 16384):
            T.TILE_ELEMENTS = tile
            tiles[tile] = round(bench(v["kernel"]), 4)
        T.TILE_ELEMENTS = 4096
        row = {
            "case": name, "L": L_, "H": H_, **{f"{key}_ms": round(x, 4) for key, x in ms.items()},
            "fast_x_eager": round(ms["eager"] / ms["fast"], 2),
            "fast_x_compile": round(ms["compile"] / ms["fast"], 2) if "compile" in ms else None,
            "fast_of_clone": round(ms["clone"] / ms["fast"], 3),
            "kernel_of_clone": round(ms["clone"] / ms["kernel"], 3),
            "kernel_GBps": round(moved / ms["kernel"] / 1e6, 1),
            "kernel_ms_by_tile": tiles,
        }  # fmt: skip
        rows.append(row)
        print(row, flush=True)
        del roof
res["speed"] = rows
os.makedirs(OUT, exist_ok=True)
with open(os.path.join(OUT, "qk_norm_rope_gpu.json"), "w") as f:
    json.dump(res, f, indent=1)
print("wrote", os.path.join(OUT, "qk_norm_rope_gpu.json"))
