"""One GPU session's checks and timings, written for a single short run on a lent GPU.

    PYTHONUNBUFFERED=1 python benchmarks/gpu/check_gpu.py OUT_DIR

Sections, each writing OUT_DIR/gpu.json as it finishes (a run cut short keeps what it has):
1. fp32_layer_norm on cuda: the dispatcher's path, its precision against forward_native
   on the same device (bf16, fp16, fp32), and bandwidth against a clone of the same bytes
   and torch.compile of the meaning, at the issue's shapes, sweeping num_warps.
2. block_sparse_attention on cuda: agreement with the native reference (small shape),
   then [1, 12, S, 128] bf16 at keep 0.5/0.25/0.1 against dense SDPA, and the estimate.
3. The launch-config tuner (DITOPS_TUNE=on, ditops.core.tune_launch.launch_config): the Triton
   LayerNorm/modulation kernels at Wan and FLUX shapes, the config chosen per shape
   class (printed and in gpu.json "tuned"), and the kernel's time with the static config
   against the tuned one, interleaved.
4. The small Wan model end to end (ditops bench's default), unpatched vs patched.

Sections 1, 2 and 4 run with DITOPS_TUNE=off (the static configs), section 3 with it on;
its cache goes to OUT_DIR/tune-cache.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

# ruff: noqa: B023 - every lambda is timed inside the loop iteration that made it

sys.path.insert(0, os.path.join(os.getcwd(), "src"))
sys.path.insert(0, os.getcwd())

import torch
import torch.nn.functional as F

OUT = sys.argv[1] if len(sys.argv) > 1 else "."
RESULT: dict[str, Any] = {}
T0 = time.time()


def save() -> None:
    RESULT["elapsed_s"] = round(time.time() - T0, 1)
    with open(os.path.join(OUT, "gpu.json"), "w") as f:
        json.dump(RESULT, f, indent=1, default=str)


def bench(fn: Any) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))


def layer_norm_section() -> None:
    from tests.precision import ulp_distance

    import ditops
    from ditops import config
    from ditops.kernels.triton import layer_norm as tln

    sec: dict[str, Any] = {"precision": {}, "speed": []}
    RESULT["layer_norm"] = sec
    with torch.inference_mode():
        for dt in (torch.bfloat16, torch.float16, torch.float32):
            m = ditops.FP32LayerNorm(5120, eps=1e-6).cuda()
            torch.nn.init.normal_(m.weight)
            torch.nn.init.normal_(m.bias)
            x = (torch.randn(4096, 5120, device="cuda") * 3 + 1).to(dt)
            out, ref = m(x), m.forward_native(x)
            d = ulp_distance(out, ref)
            a = (out.float() - ref.float()).abs()
            sec["precision"][str(dt)] = {
                "path": m.explain_call(x).chosen,
                "frac_diff": float((d > 0).float().mean()),
                "max_ulp": int(d.max()),
                "beyond_1ulp_and_1e-5": int(((d > 1) & (a > 1e-5)).sum()),
                "max_abs": float(a.max()),
            }
            with config.override(precision="exact"):
                sec["precision"][str(dt)]["exact_bitwise"] = bool(torch.equal(m(x), ref))
        save()
        compiled = torch.compile(
            lambda x, w, b: F.layer_norm(x.float(), (x.shape[-1],), w, b, 1e-6).to(x.dtype)
        )
        original = tln.launch_config
        for rows in (4096, 8192, 16384, 32760):
            for c in (1536, 3072, 5120):
                sweep = rows in (8192, 32760)
                x = torch.randn(rows, c, device="cuda", dtype=torch.bfloat16)
                w = torch.randn(c, device="cuda")
                b = torch.randn(c, device="cuda")
                row: dict[str, Any] = {"rows": rows, "C": c}
                row["clone_ms"] = bench(lambda x=x: x.clone())
                row["native_ms"] = bench(
                    lambda x=x, w=w, b=b: F.layer_norm(x.float(), (c,), w, b, 1e-6).to(x.dtype)
                )
                row["compile_ms"] = bench(lambda x=x, w=w, b=b: compiled(x, w, b))
                row["ditops_ms"] = bench(lambda x=x, w=w, b=b: tln.fp32_layer_norm(x, w, b, 1e-6))
                out = torch.empty_like(x)
                # The kernel alone (no custom-op or argument-checking overhead on the host).
                row["kernel_ms"] = bench(
                    lambda x=x, w=w, b=b: tln.launch_layer_norm(x, out, w, b, 1e-6)
                )
                for warps, bm_cap in [(4, 1), (8, 1), (16, 1), (4, 2), (8, 2)] if sweep else []:

                    def cfg(n: int, cc: int, mx: int, warps: int = warps, cap: int = bm_cap):
                        bm, bc, loop, _ = original(n, cc, mx)
                        return max(bm, cap) if not loop else bm, bc, loop, warps

                    tln.launch_config = cfg
                    try:
                        ms = bench(lambda x=x, w=w, b=b: tln.launch_layer_norm(x, out, w, b, 1e-6))
                    finally:
                        tln.launch_config = original
                    row[f"w{warps}_m{bm_cap}_ms"] = ms
                sec["speed"].append(row)
                save()


def attention_section() -> None:
    from ditops.layers.sparse_attention import dense_attention
    from ditops.ops.block_sparse_attention import block_sparse_attention
    from ditops.ops.estimate_block_mask import estimate_block_mask

    sec: dict[str, Any] = {"agreement": {}, "speed": []}
    RESULT["attention"] = sec
    torch.manual_seed(0)
    with torch.inference_mode():
        q, k, v = (
            torch.randn(1, 4, 1000, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3)
        )
        kvb = (1000 + 127) // 128
        mask = (torch.rand(1, 4, kvb, kvb, device="cuda") < 0.5).to(torch.int8)
        mask[..., 0] = 1
        counts = mask.sum(-1, dtype=torch.int32)
        from ditops.ops.block_sparse_attention import BlockSparseAttentionOp

        op = BlockSparseAttentionOp()
        fast = op(q, k, v, mask, counts)
        ref = op.forward_native(
            q, k, v, mask, counts, layout="BNSD", scale=None, causal=False, block_size=128
        )
        sec["agreement"] = {
            "path": op.explain_call(q, k, v, mask, counts).chosen,
            "max_abs": float((fast.float() - ref.float()).abs().max()),
        }
        save()
        for s in (8192, 32760):
            if s > 8192 and time.time() - T0 > 200:
                break
            q, k, v = (
                torch.randn(1, 12, s, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3)
            )
            row: dict[str, Any] = {"S": s, "dense_ms": bench(lambda: dense_attention(q, k, v))}
            nb = (s + 127) // 128
            for keep in (0.5, 0.25, 0.1):
                m = (torch.rand(1, 12, nb, nb, device="cuda") < keep).to(torch.int8)
                m[..., 0] = 1
                cnt = m.sum(-1, dtype=torch.int32)
                t0 = time.time()
                block_sparse_attention(q, k, v, m, cnt)
                torch.cuda.synchronize()
                row[f"first_call_s_keep{keep}"] = round(time.time() - t0, 1)
                row[f"sparse_ms_keep{keep}"] = bench(
                    lambda m=m, cnt=cnt: block_sparse_attention(q, k, v, m, cnt)
                )
                row[f"speedup_keep{keep}"] = row["dense_ms"] / row[f"sparse_ms_keep{keep}"]
            row["estimate_ms"] = bench(lambda: estimate_block_mask(q, k, keep_ratio=0.25))
            row["estimate_share_of_dense"] = row["estimate_ms"] / row["dense_ms"]
            sec["speed"].append(row)
            save()


def tuned_section() -> None:
    from dataclasses import replace

    from ditops import config
    from ditops.core import tune
    from ditops.kernels.triton import layer_norm as tln
    from ditops.kernels.triton import modulation as tmod

    sec: dict[str, Any] = {"speed": [], "choices": {}}
    RESULT["tuned"] = sec
    on = replace(config.get(), tune="on", cache_dir=os.path.join(OUT, "tune-cache"))
    off = replace(on, tune="off")
    with torch.inference_mode():
        for rows, c in ((8064, 1536), (32760, 1536), (4608, 3072), (8192, 5120)):
            x = torch.randn(1, rows, c, device="cuda", dtype=torch.bfloat16)
            w, b = torch.randn(c, device="cuda"), torch.randn(c, device="cuda")
            s_, t_ = (torch.randn(1, 1, c, device="cuda") * 0.1 for _ in range(2))
            cases = {
                "layer_norm": lambda x=x, w=w, b=b: tln.fp32_layer_norm(x, w, b, 1e-6),
                "ln_scale_shift": lambda x=x, s_=s_, t_=t_: tmod.layer_norm_scale_shift(
                    x, None, None, s_, t_, 1e-6
                ),
            }
            for name, fn in cases.items():
                config._local.override = on
                t0 = time.time()
                fn()  # the first call of the class times its configs
                torch.cuda.synchronize()
                row = {"case": name, "rows": rows, "C": c, "tuning_s": round(time.time() - t0, 2)}
                row["tuned_ms"] = bench(fn)
                config._local.override = off
                row["static_ms"] = bench(fn)
                config._local.override = on
                row["tuned_ms_again"] = bench(fn)
                config._local.override = None
                sec["speed"].append(row)
                print(row, flush=True)
                save()
    found = tune.choices(on)
    sec["choices"] = {k: {"winner": v.winner, "why": v.why()} for k, v in found.items()}
    print("\n".join(tune.describe(found)), flush=True)
    save()


def wan_section() -> None:
    from ditops.bench import wan

    result = wan.run(
        torch.device("cuda"), "small", progress=False, plot_path=os.path.join(OUT, "wan-gpu.png")
    )
    RESULT["wan"] = {"summary": result["summary"], "rows": result["rows"]}
    save()


def main() -> None:
    import triton

    RESULT["gpu"] = torch.cuda.get_device_name()
    RESULT["torch"] = torch.__version__
    RESULT["triton"] = triton.__version__
    os.environ["DITOPS_TUNE"] = "off"  # the static configs, but in tuned_section
    from ditops import config

    config.reload()
    for name, fn in (
        ("layer_norm", layer_norm_section),
        ("attention", attention_section),
        ("tuned", tuned_section),
        ("wan", wan_section),
    ):
        t = time.time()
        if name == "wan" and t - T0 > 300:
            RESULT["wan_skipped"] = f"no time left ({t - T0:.0f} s elapsed)"
            continue
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - report and go on to the next section
            import traceback

            RESULT[f"{name}_error"] = traceback.format_exc()[-3000:]
            print(f"{name} failed: {exc}", flush=True)
        print(f"{name}: {time.time() - t:.0f} s", flush=True)
        save()


if __name__ == "__main__":
    main()
