"""Why does the Triton LayerNorm reach ~40% of clone bandwidth on H200? One run of variants.

python benchmarks/gpu/ln_experiment.py OUT_DIR
"""

from __future__ import annotations

# ruff: noqa: B023 - every lambda is timed inside the loop iteration that made it
import json
import os
import sys

sys.path.insert(0, os.path.join(os.getcwd(), "src"))
import torch
import triton
import triton.language as tl
import triton.testing


@triton.jit
def copy_rows(X, Y, C, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < C
    tl.store(Y + row * C + cols, tl.load(X + row * C + cols, mask=m), mask=m)


@triton.jit
def ln_simple(X, W, B, Y, C, eps, BLOCK: tl.constexpr, RNE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < C
    x = tl.load(X + row * C + cols, mask=m, other=0.0).to(tl.float32)
    mean = tl.sum(x, 0) / C
    xc = tl.where(m, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, 0) / C + eps)
    y = xc * rstd * tl.load(W + cols, mask=m) + tl.load(B + cols, mask=m)
    if RNE:
        bits = y.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        y = bits.to(tl.float32, bitcast=True)
    tl.store(Y + row * C + cols, y.to(tl.bfloat16), mask=m)


@triton.jit
def ln_multirow(X, W, B, Y, R, C, eps, BM: tl.constexpr, BLOCK: tl.constexpr):
    rows = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = (rows < R)[:, None] & (cols < C)[None, :]
    off = rows[:, None] * C + cols[None, :]
    x = tl.load(X + off, mask=m, other=0.0).to(tl.float32)
    mean = tl.sum(x, 1) / C
    xc = tl.where(m, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, 1) / C + eps)
    cm = cols < C
    y = (
        xc * rstd[:, None] * tl.load(W + cols, mask=cm)[None, :]
        + tl.load(B + cols, mask=cm)[None, :]
    )
    tl.store(Y + off, y.to(tl.bfloat16), mask=m)


def bench(fn):
    return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))


def main() -> None:
    from ditops.kernels.triton import layer_norm as tln

    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    res = []
    for rows, c in ((8192, 1536), (8192, 5120), (32760, 3072), (32760, 5120)):
        x = torch.randn(rows, c, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(c, device="cuda")
        b = torch.randn(c, device="cuda")
        y = torch.empty_like(x)
        blk = triton.next_power_of_2(c)
        r = {"rows": rows, "C": c, "clone": bench(lambda: x.clone())}
        r["copy_out"] = bench(lambda: y.copy_(x))
        r["aten_bf16"] = bench(
            lambda: torch.nn.functional.layer_norm(x, (c,), w.bfloat16(), b.bfloat16(), 1e-6)
        )
        for nw in (4, 8, 16, 32):
            r[f"copy_rows_w{nw}"] = bench(
                lambda nw=nw: copy_rows[(rows,)](x, y, c, BLOCK=blk, num_warps=nw)
            )
            r[f"simple_w{nw}"] = bench(
                lambda nw=nw: ln_simple[(rows,)](
                    x, w, b, y, c, 1e-6, BLOCK=blk, RNE=False, num_warps=nw
                )
            )
        r["simple_w8_rne"] = bench(
            lambda: ln_simple[(rows,)](x, w, b, y, c, 1e-6, BLOCK=blk, RNE=True, num_warps=8)
        )
        r["simple_w8_nofma"] = bench(
            lambda: ln_simple[(rows,)](
                x, w, b, y, c, 1e-6, BLOCK=blk, RNE=True, num_warps=8, enable_fp_fusion=False
            )
        )
        for bm, nw in ((2, 8), (4, 8), (4, 16)):
            r[f"multirow_m{bm}_w{nw}"] = bench(
                lambda bm=bm, nw=nw: ln_multirow[(triton.cdiv(rows, bm),)](
                    x, w, b, y, rows, c, 1e-6, BM=bm, BLOCK=blk, num_warps=nw
                )
            )
        r["ditops_kernel"] = bench(lambda: tln.launch_layer_norm(x, y, w, b, 1e-6))
        res.append(r)
        print(
            {
                k: (round(r["clone"] / v, 2) if isinstance(v, float) and k != "clone" else v)
                for k, v in r.items()
            },
            flush=True,
        )
        with open(os.path.join(out_dir, "ln_experiment.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
