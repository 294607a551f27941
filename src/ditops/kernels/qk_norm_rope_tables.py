"""What the q/k prologue kernels share: the per-pair views of the rotary tables and the
dtype of the normalised tensor. (The ops' arguments are checked in
:mod:`ditops.ops.qk_norm_rope_args`; the kernels get them checked.)

Kernels see the ``[Bt, L, Dt]`` tables as four ``[Bt, L, D/2]`` views (no copy),
``(c1, s1, c2, s2)``: the first member of pair ``i`` uses ``c1[i], s1[i]``, the second
``c2[i], s2[i]`` (:func:`pair_tables`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

#: The low-precision dtypes the kernels round to (the ops take fp32, bf16 and fp16).
LOW_PRECISION = (torch.bfloat16, torch.float16)


def normed_dtype(x_dtype: torch.dtype, w_dtype: torch.dtype | None, convention: str) -> torch.dtype:
    """The dtype of the normalised tensor (and of the fused op's outputs).

    ``torch``: the input's (``F.rms_norm`` rounds its fp32 result to it). ``diffusers``:
    the input's without a weight; a bf16/fp16 weight's dtype (its ``RMSNorm`` rounds to
    the weight's dtype and multiplies there); with an fp32 weight, fp32 (the product of
    the fp32 normalised value and the weight, never rounded back).
    """
    if convention == "torch" or w_dtype is None:
        return x_dtype
    if w_dtype in LOW_PRECISION:
        return w_dtype
    return torch.promote_types(torch.float32, w_dtype)


class PairTables(NamedTuple):
    """``[Bt, L, D/2]`` views: pair i's first member uses (c1, s1), its second (c2, s2)."""

    c1: torch.Tensor
    s1: torch.Tensor
    c2: torch.Tensor
    s2: torch.Tensor

    @property
    def paired(self) -> bool:
        """One angle per pair: both members read the same entries."""
        return self.c1 is self.c2 and self.s1 is self.s2


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (``-0.0`` is not ``0.0``; a NaN equals the same NaN)."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.view(ints), b.view(ints))


def pair_tables(cos3: torch.Tensor, sin3: torch.Tensor, D: int, layout: str) -> PairTables:
    """The four per-pair views of ``[Bt, L, Dt]`` tables.

    Full-width tables whose two members of every pair hold the same bits (all tables
    diffusers builds: ``repeat_interleave`` or ``cat`` of one angle per pair) are
    reduced to one angle per pair; the arithmetic then is the same bit for bit, and the
    kernels can use their faster form. The check reads the tables once (1/H of the
    activations' size).
    """
    h = D // 2
    if cos3.shape[-1] == h:
        return PairTables(cos3, sin3, cos3, sin3)
    if layout == "interleaved":
        c1, c2, s1, s2 = cos3[..., 0::2], cos3[..., 1::2], sin3[..., 0::2], sin3[..., 1::2]
    else:
        c1, c2, s1, s2 = cos3[..., :h], cos3[..., h:], sin3[..., :h], sin3[..., h:]
    if _bits_equal(c1, c2) and _bits_equal(s1, s2):
        return PairTables(c1, s1, c1, s1)
    return PairTables(c1, s1, c2, s2)
