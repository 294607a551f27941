"""The Triton block-mask estimate on a GPU: agreement with native, and its cost against dense.

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu/estimate.py OUT_DIR

Writes OUT_DIR/estimate.json after every case (a run cut short keeps what it has) and
prints a summary. Every case is guarded: a failure is recorded and the next case runs.
About 2-3 minutes on an H200, most of it Triton compiles (later sections are skipped
when the time is spent). Sections:

1. ``agreement`` (3001 tokens, 8 query / 2 key heads, D 128): Triton block scores against
   native ``block_scores`` on the same GPU, as the worst error in units of the tolerance
   of tests/attention/estimate_ties.py (<= 1 passes), for bf16 (passes 1 and 2, causal
   or not, stride 8 and 16), fp16 and fp32; masks through the op against native
   (differing blocks, near-tie violations); a NaN query.
2. ``cost``: [1, H, S, 128] bf16, H in (12, 40), S in (32768, 8192), stride 16 and 8:
   dense SDPA (flash backend, and the default backend), Triton block scores (passes 1
   and 2), the whole op (scores + selection at keep_ratio 0.25), the selection alone,
   the torch estimate (forward_native); shares of dense; the scores' TFLOP/s; masks
   against native at that size.
3. ``tiles``: other tile shapes for passes=1 at S 32768, 40 heads, stride 16 and 8.

``DITOPS_SMOKE=1`` runs the same code on CPU through Triton's interpreter at tiny sizes:
it checks the script, not the GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

# ruff: noqa: B023 - every lambda is timed inside the loop iteration that made it

# A smoke run needs the interpreter, which Triton reads when it is first imported.
os.environ.setdefault("TRITON_INTERPRET", os.environ.get("DITOPS_SMOKE", "0"))
sys.path.insert(0, os.path.join(os.getcwd(), "src"))
sys.path.insert(0, os.getcwd())

import torch
import torch.nn.functional as F

import ditops

SMOKE = os.environ.get("DITOPS_SMOKE") == "1"
OUT = sys.argv[1] if len(sys.argv) > 1 else "."
RESULT: dict[str, Any] = {"errors": []}
T0 = time.time()
DEV = "cpu" if SMOKE else "cuda"
# Sizes: (block_size, strides, head dim, agreement tokens, cost (S, heads) cases).
BLOCK = 32 if SMOKE else 128
STRIDES = (4, 8) if SMOKE else (16, 8)
DIM = 32 if SMOKE else 128
AGREE_S = 161 if SMOKE else 3001
COST = [(300, 2)] if SMOKE else [(32768, 40), (32768, 12), (8192, 40), (8192, 12)]
BUDGET_S = 170  # stop starting new cases after this many seconds


def save() -> None:
    RESULT["elapsed_s"] = round(time.time() - T0, 1)
    with open(os.path.join(OUT, "estimate.json"), "w") as f:
        json.dump(RESULT, f, indent=1, default=str)


def bench(fn: Callable[[], Any]) -> float:
    """Median milliseconds per call."""
    if SMOKE:
        times = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median"))


def guarded(section: str, name: str, fn: Callable[[], None]) -> None:
    if time.time() - T0 > BUDGET_S:
        RESULT.setdefault("skipped", []).append(f"{section}/{name}: out of time")
        return
    t = time.time()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - record it and go on to the next case
        RESULT["errors"].append({"case": f"{section}/{name}", "trace": traceback.format_exc()})
        print(f"{section}/{name} failed: {type(exc).__name__}: {exc}", flush=True)
    print(f"{section}/{name}: {time.time() - t:.1f} s", flush=True)
    if not SMOKE:
        torch.cuda.empty_cache()
    save()


def qk(heads: int, kv_heads: int, seq: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(1, heads, seq, DIM, device=DEV, generator=gen).to(dtype)
    k = torch.randn(1, kv_heads, seq, DIM, device=DEV, generator=gen).to(dtype)
    return q, k


def mask_agreement(q, k, opts: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """The op's mask (Triton path) against forward_native's, with the near-tie check."""
    from tests.attention.estimate_ties import ATOL, near_tie_violations, rtol

    from ditops.attention.estimate import block_scores
    from ditops.ops.estimate_block_mask import estimate_block_mask

    kw = {"block_size": BLOCK, "stride": opts["stride"], "keep_ratio": opts["keep_ratio"],
          "threshold": opts["threshold"], "causal": opts["causal"]}  # fmt: skip
    with torch.inference_mode():
        path = estimate_block_mask.op.explain_call(q, k, **kw).chosen
        mask, _ = estimate_block_mask(q, k, **kw)
        want, _ = estimate_block_mask.op.forward_native(
            q, k, layout="BNSD", scale=None, keep_sink=True, keep_recent=True,
            dense_blocks=0, **kw,
        )  # fmt: skip
        scores = block_scores(
            q, k, block_size=BLOCK, stride=opts["stride"],
            score_scale=DIM**-0.5 / opts["stride"], causal=opts["causal"],
        )  # fmt: skip
    diff = mask != want
    rows = int(diff.any(-1).sum())
    bad = near_tie_violations(
        mask.cpu(), want.cpu(), scores.cpu(), (rtol(dtype, 1), ATOL), max_rows=300,
        keep_sink=True, keep_recent=True, **{n: opts[n] for n in ("threshold", "keep_ratio",
                                                                   "causal")},
    )  # fmt: skip
    return {
        "path": path,
        "blocks_differing": int(diff.sum()),
        "fraction_differing": float(diff.float().mean()),
        "rows_differing": rows,
        "rows_checked": min(rows, 300),
        "near_tie_violations": len(bad),
        "first_violations": bad[:5],
    }


# --- 1. agreement ------------------------------------------------------------------------


def agreement_section() -> None:
    from tests.attention.estimate_ties import ATOL, rtol

    from ditops.attention.estimate import block_scores as native_scores
    from ditops.kernels.triton import estimate as tes

    sec: dict[str, Any] = {"scores": [], "masks": []}
    RESULT["agreement"] = sec
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    cases = [(bf16, p, c, s) for s in STRIDES for p in (1, 2) for c in (False, True)]
    cases += [(fp16, 1, False, STRIDES[1]), (fp32, 1, True, STRIDES[1])]
    for dtype, passes, causal, stride in cases:

        def one() -> None:
            q, k = qk(8, 2, AGREE_S, dtype, seed=stride)
            kw = {"block_size": BLOCK, "stride": stride, "score_scale": DIM**-0.5 / stride,
                  "causal": causal}  # fmt: skip
            with torch.inference_mode():
                want = native_scores(q, k, **kw)
                t = time.time()
                got = tes.block_scores(q, k, passes=passes, **kw)
                if not SMOKE:
                    torch.cuda.synchronize()
                first_s = time.time() - t
            err = (got - want).abs()
            bound = rtol(dtype, passes) * want.abs() + ATOL
            ok = ~want.isnan()
            sec["scores"].append({
                "dtype": str(dtype), "passes": passes, "causal": causal, "stride": stride,
                "worst_error_in_tolerances": float((err[ok] / bound[ok]).max()),
                "max_rel_error": float((err[ok] / want[ok].abs().clamp_min(1e-6)).max()),
                "bitwise_equal": bool(torch.equal(got, want)),
                "nan_same": bool(torch.equal(got.isnan(), want.isnan())),
                "first_call_s": round(first_s, 2),
            })  # fmt: skip

        guarded("agreement", f"scores {dtype} passes={passes} causal={causal} st={stride}", one)

    for dtype, opts in [
        (bf16, {"stride": STRIDES[1], "keep_ratio": 0.25, "threshold": 1.0, "causal": False}),
        (bf16, {"stride": STRIDES[0], "keep_ratio": 1.0, "threshold": 0.9, "causal": False}),
        (bf16, {"stride": STRIDES[1], "keep_ratio": 0.3, "threshold": 0.95, "causal": True}),
        (fp16, {"stride": STRIDES[1], "keep_ratio": 0.25, "threshold": 1.0, "causal": False}),
    ]:

        def masks() -> None:
            q, k = qk(8, 2, AGREE_S, dtype, seed=7)
            sec["masks"].append({"dtype": str(dtype), **opts,
                                 **mask_agreement(q, k, opts, dtype)})  # fmt: skip

        guarded("agreement", f"masks {dtype} {opts}", masks)

    def nan() -> None:
        from ditops.ops.estimate_block_mask import estimate_block_mask

        q, k = qk(8, 2, AGREE_S, bf16, seed=3)
        q[0, 1, AGREE_S // 3, 0] = float("nan")
        with torch.inference_mode():
            got = estimate_block_mask(q, k, block_size=BLOCK, stride=STRIDES[1], keep_ratio=0.3)
            want = estimate_block_mask.op.forward_native(
                q, k, layout="BNSD", block_size=BLOCK, stride=STRIDES[1], scale=None,
                threshold=1.0, keep_ratio=0.3, keep_sink=True, keep_recent=True,
                causal=False, dense_blocks=0,
            )  # fmt: skip
        row = got[0][0, 1, AGREE_S // 3 // BLOCK]
        sec["nan"] = {
            "masks_equal": bool(torch.equal(got[0], want[0])),
            "nan_row_kept_blocks": row.nonzero().flatten().tolist(),
        }

    guarded("agreement", "nan", nan)


# --- 2. cost -----------------------------------------------------------------------------


def dense_fns(q, k, v) -> dict[str, Callable[[], Any]]:
    fns: dict[str, Callable[[], Any]] = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v)}
    if not SMOKE:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def flash() -> Any:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v)

        fns = {"flash": flash, **fns}
    return fns


def cost_section() -> None:
    from ditops.attention.estimate import mask_from_scores
    from ditops.kernels.triton import estimate as tes
    from ditops.ops.estimate_block_mask import estimate_block_mask

    rows: list[dict[str, Any]] = []
    RESULT["cost"] = rows
    select = {"threshold": 1.0, "keep_ratio": 0.25, "keep_sink": True, "keep_recent": True,
              "causal": False, "dense_blocks": 0}  # fmt: skip
    for seq, heads in COST:
        q, k = qk(heads, heads, seq, torch.bfloat16)
        v = torch.randn_like(q)
        dense: dict[str, float] = {}

        def time_dense() -> None:
            with torch.inference_mode():
                for name, fn in dense_fns(q, k, v).items():
                    dense[name] = bench(fn)

        guarded("cost", f"dense S={seq} H={heads}", time_dense)
        for stride in STRIDES:

            def one() -> None:
                row: dict[str, Any] = {"S": seq, "heads": heads, "stride": stride}
                row.update({f"dense_{n}_ms": t for n, t in dense.items()})
                kw = {"block_size": BLOCK, "stride": stride,
                      "score_scale": DIM**-0.5 / stride, "causal": False}  # fmt: skip
                op_kw = {"block_size": BLOCK, "stride": stride, "keep_ratio": 0.25}
                with torch.inference_mode():
                    for passes in (1, 2):
                        ms = bench(lambda: tes.block_scores(q, k, passes=passes, **kw))
                        row[f"scores_p{passes}_ms"] = ms
                        flop = passes * 2 * heads * (seq / stride) ** 2 * stride * DIM
                        row[f"scores_p{passes}_tflops"] = flop / ms / 1e9
                    scores = tes.block_scores(q, k, **kw)
                    row["selection_ms"] = bench(lambda: mask_from_scores(scores, **select))
                    row["op_ms"] = bench(lambda: estimate_block_mask(q, k, **op_kw))
                    row["native_ms"] = bench(
                        lambda: estimate_block_mask.op.forward_native(
                            q, k, layout="BNSD", scale=None, **op_kw,
                            **{n: x for n, x in select.items() if n != "keep_ratio"},
                        )
                    )  # fmt: skip
                base = dense.get("flash", dense.get("sdpa"))
                if base:
                    for name in ("scores_p1", "scores_p2", "op", "native"):
                        row[f"{name}_share_of_dense"] = row[f"{name}_ms"] / base
                    if "sdpa" in dense:
                        row["op_share_of_sdpa"] = row["op_ms"] / dense["sdpa"]
                row["masks"] = mask_agreement(
                    q, k, {"stride": stride, "keep_ratio": 0.25, "threshold": 1.0,
                           "causal": False}, torch.bfloat16,
                )  # fmt: skip
                rows.append(row)
                print(
                    f"S={seq} H={heads} stride={stride}: dense {base:.3f} ms, scores "
                    f"p1 {row['scores_p1_ms']:.3f} ms ({row['scores_p1_tflops']:.0f} TFLOP/s), "
                    f"p2 {row['scores_p2_ms']:.3f} ms, op {row['op_ms']:.3f} ms = "
                    f"{row.get('op_share_of_dense', math.nan):.1%} of dense, native "
                    f"{row['native_ms']:.3f} ms",
                    flush=True,
                )

            guarded("cost", f"S={seq} H={heads} stride={stride}", one)


# --- 3. tiles ----------------------------------------------------------------------------


def tiles_section() -> None:
    from ditops.kernels.triton import estimate as tes

    rows: list[dict[str, Any]] = []
    RESULT["tiles"] = rows
    seq, heads = COST[0]
    q, k = qk(heads, heads, seq, torch.bfloat16)
    # The default (128x128x64, 8 warps, 3 stages) and one change at a time.
    variants = [
        tes.Tiles(),
        tes.Tiles(block_n=256),
        tes.Tiles(num_stages=4),
        tes.Tiles(num_warps=4),
        tes.Tiles(block_m=64, num_warps=4),
    ]
    for stride in STRIDES:
        for tiles in variants:

            def one() -> None:
                blocks = math.ceil(seq / BLOCK)
                out = torch.zeros(1, heads, blocks, blocks, device=DEV)
                qs = q * (DIM**-0.5 / stride)
                with torch.inference_mode():
                    ms = bench(
                        lambda: tes.launch(qs, k, out, block_size=BLOCK, stride=stride,
                                           causal=False, tiles=tiles)
                    )  # fmt: skip
                flop = 2 * heads * (seq / stride) ** 2 * stride * DIM
                rows.append({"stride": stride, **dataclasses.asdict(tiles), "ms": ms,
                             "tflops": flop / ms / 1e9})  # fmt: skip

            guarded("tiles", f"stride={stride} {tiles}", one)


def main() -> None:
    import triton

    RESULT["device"] = "cpu (interpreter smoke run)" if SMOKE else torch.cuda.get_device_name()
    RESULT["torch"] = torch.__version__
    RESULT["triton"] = triton.__version__
    save()
    # The smoke run's CPU tensors take the cuda path (Triton's interpreter).
    with ditops.force_device_kind({"cpu": "cuda"}) if SMOKE else contextlib.nullcontext():
        agreement_section()
        cost_section()
        tiles_section()
    save()
    print(json.dumps({"cost": RESULT.get("cost"), "errors": len(RESULT["errors"])}, indent=1,
                     default=str))  # fmt: skip


if __name__ == "__main__":
    main()
