"""Page faults per call of the blocked CPU kernels; run by test_cpu_blocks in a fresh process
(the allocator's state is the process's).

Prints JSON: what the page probe answers, and per case the minor page faults of a warm
call with the kernels' own plan (``faults``) and with one LayerNorm call per block forced
(``whole``), next to the pages the call's outputs take (``out_pages``); and the probe's
answer once the cases have run. [1, 1024, 1024] bf16 in blocks of 1 MiB (the modulation
kernels' are made that small too, to keep this quick): 4 blocks per call.
"""

from __future__ import annotations

import json
import mmap
import resource
from collections.abc import Callable
from typing import Any

import torch

from ditops.kernels.cpu import blocks
from ditops.kernels.cpu import layer_norm as LN
from ditops.kernels.cpu import modulation as K
from ditops.ops import modulation_args as shapes

L, C = 1024, 1024
BLOCK_BYTES = 1 << 20
EPS = 1e-6


def _faults(fn: Callable[[], Any]) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fn()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def _operand(value: object, x: torch.Tensor) -> torch.Tensor | None:
    mod = shapes.check_modulation(value, x, "probe", "m", (torch.float32, x.dtype))
    return shapes.exact_operand(mod, x)


def _cases() -> dict[str, tuple[Callable[[], Any], int]]:
    gen = torch.Generator().manual_seed(0)

    def rnd(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.5).to(dtype)

    x, r = rnd(1, L, C, dtype=torch.bfloat16), rnd(1, L, C, dtype=torch.bfloat16)
    w, b = rnd(C) + 1, rnd(C)
    out_bytes = x.numel() * x.element_size()
    # per-token bf16 modulation: every conversion the exact kernels make in scratch
    g, s, t = (_operand(rnd(1, L, C, dtype=torch.bfloat16), x) for _ in range(3))
    # per-sample fp32 modulation: the fast kernel's folded mixed-dtype LayerNorm
    g1, s1, t1 = (_operand(rnd(1, 1, C), x) for _ in range(3))
    bf16 = torch.bfloat16
    cases: dict[str, tuple[Callable[[], Any], int]] = {
        "fp32_layer_norm exact": (
            lambda: LN.fp32_layer_norm(x[0], [C], w, b, EPS, True),
            out_bytes,
        ),
        "ln_mod per_token_bf16 exact": (
            lambda: K.layer_norm_scale_shift(x, w, b, s, t, EPS, bf16, True),
            out_bytes,
        ),
        "fused per_token_bf16 exact": (
            lambda: K.scale_residual_layer_norm_scale_shift(r, x, g, w, b, s, t, EPS, bf16, True),
            2 * out_bytes,
        ),
        "fused per_token_bf16 fast": (
            lambda: K.scale_residual_layer_norm_scale_shift(r, x, g, w, b, s, t, EPS, bf16, False),
            2 * out_bytes,
        ),
        "fused per_sample fast": (
            lambda: K.scale_residual_layer_norm_scale_shift(
                r, x, g1, w, b, s1, t1, EPS, bf16, False
            ),
            2 * out_bytes,
        ),
    }
    return cases


def main() -> None:
    LN._BLOCK_BYTES = K._BLOCK_BYTES = BLOCK_BYTES
    result: dict[str, Any] = {"probe": [blocks.fresh_pages(BLOCK_BYTES) for _ in range(3)]}
    cases = _cases()
    measured: dict[str, dict[str, int]] = {}
    for name, (fn, out_bytes) in cases.items():
        fn()  # sizes the scratch
        measured[name] = {
            "faults": min(_faults(fn) for _ in range(2)),
            "out_pages": out_bytes // mmap.PAGESIZE,
        }
    result["probe_after"] = blocks.fresh_pages(BLOCK_BYTES)
    blocks.fresh_pages = lambda nbytes: False  # type: ignore[assignment]
    for name, (fn, _) in cases.items():
        fn()
        measured[name]["whole"] = _faults(fn)
    result["cases"] = measured
    result["block_pages"] = BLOCK_BYTES // mmap.PAGESIZE
    print(json.dumps(result))


if __name__ == "__main__":
    main()
