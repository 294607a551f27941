"""Rotary tables given as complex numbers (Qwen-Image, Z-Image), for ``qk_norm_rope``.

Both models rotate q and k as diffusers writes it with complex arithmetic: the pairs
``(x[2i], x[2i+1])`` of ``x.float()`` read as complex numbers, times a complex64 table,
read back as pairs and rounded to x's dtype. The product ``(a + bi)(c + di) = (ac - bd) +
(ad + bc)i`` is ``qk_norm_rope``'s ``x * cos + rotate(x) * sin`` (interleaved pairs, fp32
tables ``cos = c``, ``sin = d``) term for term: bitwise on the CPU, where ATen multiplies
complex numbers with separate products and sums. A GPU compiler may contract the complex
product into fused multiply-adds, which the op's meaning (separate roundings) does not
have: exact precision off the CPU keeps diffusers' own code.
"""

from __future__ import annotations

from typing import Any

import torch


def complex_tables(freqs: Any, dims: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(cos, sin)``, the real and imaginary parts of a complex64 table with ``dims``
    dims (``[L, D/2]``: Qwen-Image's; ``[B, L, D/2]``: Z-Image's, given as ``[B, L, 1,
    D/2]``), or None for any other table."""
    if not isinstance(freqs, torch.Tensor) or freqs.dtype != torch.complex64:
        return None
    if freqs.dim() != dims:
        return None
    if dims == 3:
        freqs = freqs.unsqueeze(2)
    return freqs.real, freqs.imag


def exact_off_the_cpu(op: Any, x: torch.Tensor) -> bool:
    """Whether ``op`` would run exact precision on a device other than the CPU, where the
    complex product may round differently from the op (see the module docstring)."""
    return x.device.type != "cpu" and op.resolved_precision() == "exact"
