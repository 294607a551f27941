"""Benchmark suite ``layer_norm``: FP32LayerNorm against its meaning and torch.compile.

Per shape, bf16 input [rows, C] with fp32 weight and bias (as diffusers keeps them):
``native`` (the meaning: three passes over memory), ``compile`` (torch.compile of the
meaning), ditops ``exact`` and ``fast`` (whatever path the dispatcher picks on this
device), and ``clone`` of the input (one read and one write: the roofline). Bytes per
pass: 2 bytes read + 2 written per element. On CPU ``ditops bench`` runs it in both glibc
malloc states (the exact kernel walks blocks of rows; see :mod:`ditops.bench.harness`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from ditops import config
from ditops.bench.harness import Case
from ditops.bench.suite import Suite
from ditops.layers.norm import FP32LayerNorm

WIDTHS = (1536, 3072, 5120)  # Wan 1.3B / FLUX, Wan 14B, Wan 14B FFN-free dims
ROWS = {"small": (8192,), "full": (4096, 8192, 16384, 32760)}


def _meaning(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x.float(), (x.shape[-1],), w, b, eps).to(x.dtype)


def cases(device: torch.device, size: str) -> Iterator[Case]:
    compiled = torch.compile(_meaning, dynamic=False)
    for rows in ROWS[size]:
        for c in WIDTHS:
            gen = torch.Generator(device="cpu").manual_seed(rows + c)
            x = torch.randn(rows, c, generator=gen).to(device=device, dtype=torch.bfloat16)
            m = FP32LayerNorm(c, eps=1e-6).to(device)
            with torch.no_grad():
                m.weight.normal_()
                m.bias.normal_()
            w, b = m.weight.detach(), m.bias.detach()

            def run(precision: str, m: FP32LayerNorm = m, x: torch.Tensor = x) -> torch.Tensor:
                with torch.inference_mode(), config.override(precision=precision):
                    return m(x)

            def native(
                x: torch.Tensor = x, w: torch.Tensor = w, b: torch.Tensor = b
            ) -> torch.Tensor:
                with torch.inference_mode():
                    return _meaning(x, w, b, 1e-6)

            def comp(x: torch.Tensor = x, w: torch.Tensor = w, b: torch.Tensor = b) -> torch.Tensor:
                with torch.inference_mode():
                    return compiled(x, w, b, 1e-6)

            yield Case(
                suite="layer_norm",
                name=f"{rows}x{c} bf16",
                variants={
                    "native": native,
                    "compile": comp,
                    "exact": lambda run=run: run("exact"),
                    "fast": lambda run=run: run("fast"),
                    "clone": x.clone,
                },
                bytes_moved=2 * x.numel() * x.element_size(),
                params={"rows": rows, "C": c, "dtype": "bfloat16"},
            )


SUITE = Suite(
    name="layer_norm",
    title="FP32LayerNorm, bf16 in/out, fp32 weights",
    cases=cases,
    steps=lambda size: len(ROWS[size]) * len(WIDTHS) * 5,
    malloc_states=True,
)
