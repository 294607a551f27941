"""Benchmark suite ``modulation``: Wan's modulated norm (and the fused residual) against eager.

Per shape, bf16 activations ``[1, L, C]`` with fp32 modulation, either one row per
sample (``[B, 1, C]``: Wan2.1, Wan2.2 A14B) or one per token (``[B, L, C]``: Wan2.2
TI2V-5B). Variants, all timed in one run:

* ``native``: the eager chain of diffusers' WanTransformerBlock,
  ``(norm(h.float()) * (1 + scale) + shift).type_as(h)`` (``ln_mod``), and for the
  ``fused`` op first ``h = (h.float() + attn * gate).type_as(h)``;
* ``compile``: ``torch.compile`` of that chain;
* ditops ``exact`` and ``fast`` (whatever path the dispatcher picks on this device);
* ``clone``: a copy of as many bytes as the op must move (``bytes_moved``: one read of
  every input, one write of every output), half read and half written. With per-sample
  modulation that is exactly a clone of the activations; with per-token modulation the
  fp32 modulation tensors add to it. Its time is the memory roofline, so ``of clone``
  is the fraction of copy bandwidth reached.

On CPU ``ditops bench`` runs it in both glibc malloc states (the kernels walk blocks of
rows; see :mod:`ditops.bench.harness`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from ditops import config
from ditops.bench.harness import Case
from ditops.bench.suite import Suite
from ditops.ops.modulation_fp32 import layer_norm_scale_shift, scale_residual_layer_norm_scale_shift

WIDTHS = (1536, 3072, 5120)  # Wan 1.3B, Wan2.2 TI2V-5B, Wan 14B
ROWS = {"small": (8192,), "full": (8192, 32760)}
#: which ops each size measures: the modulated norm; the fused residual + norm
OPS = {"small": ("ln_mod",), "full": ("ln_mod", "fused")}
MODULATIONS = ("per_sample", "per_token")
EPS = 1e-6


def _ln_mod(h: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    norm = F.layer_norm(h.float(), (h.shape[-1],), None, None, EPS)
    return (norm * (1 + scale) + shift).type_as(h)


def _fused(
    h: torch.Tensor,
    attn: torch.Tensor,
    gate: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    h = (h.float() + attn * gate).type_as(h)
    return _ln_mod(h, scale, shift), h


def _inference(
    fn: Callable[..., Any], *args: Any, precision: str | None = None
) -> Callable[[], Any]:
    def run() -> Any:
        with torch.inference_mode():
            if precision is None:
                return fn(*args)
            with config.override(precision=precision):
                return fn(*args)

    return run


def _case(
    op: str, rows: int, c: int, modulation: str, device: torch.device, compiled: dict[str, Any]
) -> Case:
    gen = torch.Generator(device="cpu").manual_seed(rows * 7 + c)
    mod_rows = 1 if modulation == "per_sample" else rows

    def rand(*shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    h = rand(1, rows, c, dtype=torch.bfloat16)
    scale, shift, gate = (rand(1, mod_rows, c, scale=0.1) for _ in range(3))
    per_token = [scale, shift] if modulation == "per_token" else []
    act_bytes = h.numel() * h.element_size()
    mod_bytes = sum(t.numel() * t.element_size() for t in per_token)
    if op == "ln_mod":
        variants = {
            "native": _inference(_ln_mod, h, scale, shift),
            "compile": _inference(compiled["ln_mod"], h, scale, shift),
            "exact": _inference(
                layer_norm_scale_shift, h, None, None, scale, shift, EPS, precision="exact"
            ),
            "fast": _inference(
                layer_norm_scale_shift, h, None, None, scale, shift, EPS, precision="fast"
            ),
        }
        moved = 2 * act_bytes + mod_bytes
    else:
        attn = rand(1, rows, c, dtype=torch.bfloat16)
        if modulation == "per_token":
            per_token.append(gate)
            mod_bytes += gate.numel() * gate.element_size()
        fused = scale_residual_layer_norm_scale_shift
        args = (h, attn, gate, None, None, scale, shift, EPS)
        variants = {
            "native": _inference(_fused, h, attn, gate, scale, shift),
            "compile": _inference(compiled["fused"], h, attn, gate, scale, shift),
            "exact": _inference(fused, *args, precision="exact"),
            "fast": _inference(fused, *args, precision="fast"),
        }
        moved = 4 * act_bytes + mod_bytes
    # Written once, so its pages are real memory (a never-touched buffer reads as zeros
    # from one shared page and would make the roofline look faster than memory is).
    roof = torch.ones(moved // 2, dtype=torch.uint8, device=device)
    variants["clone"] = roof.clone
    label = "[B, 1, C]" if modulation == "per_sample" else "[B, L, C]"
    return Case(
        suite="modulation",
        name=f"{op} {rows}x{c} {modulation}",
        variants=variants,
        bytes_moved=moved,
        params={"op": op, "L": rows, "C": c, "dtype": "bfloat16", "modulation": label},
    )


def cases(device: torch.device, size: str) -> Iterator[Case]:
    compiled = {
        "ln_mod": torch.compile(_ln_mod, dynamic=False),
        "fused": torch.compile(_fused, dynamic=False),
    }
    for op in OPS[size]:
        for rows in ROWS[size]:
            for c in WIDTHS:
                for modulation in MODULATIONS:
                    yield _case(op, rows, c, modulation, device, compiled)


def _steps(size: str) -> int:
    return len(OPS[size]) * len(ROWS[size]) * len(WIDTHS) * len(MODULATIONS) * 5


SUITE = Suite(
    name="modulation",
    title="Wan modulation: (LN(h) * (1 + scale) + shift), bf16 activations, fp32 modulation",
    cases=cases,
    steps=_steps,
    malloc_states=True,
)
