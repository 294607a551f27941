"""What the Triton row kernels share (LayerNorm, modulation, the q/k prologue, GELU, the
estimate): the bf16 rounding the interpreter lacks, row views and their strides, the
modulation rows and gated sums, the checks of the host side and fresh outputs.

``round_rne``: Triton's interpreter (``TRITON_INTERPRET=1``, the CPU tests) truncates on
fp32 -> bf16 casts while GPUs round to nearest even, so it rounds with integer arithmetic
on the bits when the interpreter runs (``EXPLICIT_RNE``, fixed at import); see
:mod:`ditops.kernels.triton.layer_norm` for why it is compiled out on a GPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

# The interpreter truncates fp32 -> bf16 casts; GPUs round to nearest even (see above).
EXPLICIT_RNE = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def round_rne(x, DTYPE: tl.constexpr):
    """Round fp32 ``x`` to ``DTYPE`` to nearest even, alike on GPUs and in the interpreter."""
    if EXPLICIT_RNE and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        # The carry would turn some NaN payloads into zeros or infinities: keep NaN.
        x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    return x.to(DTYPE)


@triton.jit
def split_rows(rows, L):
    """(b, l) of flat row indices over a ``[B, L]`` grid of rows, in int64."""
    rows = rows.to(tl.int64)
    b = rows // L
    return b, rows - b * L


@triton.jit
def modulation_rows(b, tok, T, stride_b, stride_g):
    """Offsets of the modulation rows of tokens (b, tok) in a ``[Bm, G, C]`` tensor.

    Token tok of batch b uses row (b, tok // T) with T = L // G tokens per group; the host
    passes stride_b = 0 when Bm == 1 and stride_g = 0 when G == 1.
    """
    return b * stride_b + (tok // T) * stride_g


@triton.jit
def load_2d(ptr, row_off, cols, col_stride, mask):
    """Load a ``[rows, cols]`` tile as fp32 (masked lanes read 0)."""
    return tl.load(ptr + row_off[:, None] + cols[None, :] * col_stride, mask=mask, other=0.0).to(
        tl.float32
    )


@triton.jit
def gated_sum(
    R,
    X,
    G,
    r_off,
    x_off,
    g_off,
    cols,
    g_col_stride,
    mask,
    HAS_GATE: tl.constexpr,
    PROD_DTYPE: tl.constexpr,
):
    """``residual.float() + x * gate`` in fp32 with eager's rounding of the product.

    Eager multiplies ``x * gate`` in their promoted dtype ``PROD_DTYPE``: two bf16 (or
    fp16) operands give a product rounded to that dtype before the fp32 addition. The
    fp32 product of two such operands is exact, so rounding it once is eager's result.
    """
    r = load_2d(R, r_off, cols, 1, mask)
    x = load_2d(X, x_off, cols, 1, mask)
    if HAS_GATE:
        x = x * load_2d(G, g_off, cols, g_col_stride, mask)
        if PROD_DTYPE != tl.float32:
            x = round_rne(x, PROD_DTYPE).to(tl.float32)
    return r + x


def tl_dtype(dtype: torch.dtype) -> tl.dtype:
    """The Triton dtype of a supported torch dtype."""
    return _TL_DTYPES[dtype]


def row_view(x: Tensor) -> tuple[Tensor, int, int, int]:
    """Describe the rows of ``x`` (all dims but the last) as a ``[B, L]`` grid.

    Returns ``(x, L, stride_b, stride_l)`` where row r sits at offset
    ``(r // L) * stride_b + (r % L) * stride_l`` of the returned tensor, whose last dim
    has stride 1. Leading dims are merged where their strides allow; ``x`` is made
    contiguous only when the last stride is not 1 or three or more row dims remain.
    """
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        x = x.contiguous()
    merged: list[list[int]] = []
    for size, stride in zip(x.shape[:-1], x.stride()[:-1]):
        if size == 1:
            continue
        if merged and merged[-1][1] == stride * size:
            merged[-1] = [merged[-1][0] * size, stride]
        else:
            merged.append([size, stride])
    if len(merged) > 2:
        x = x.contiguous()
        merged = [[x.numel() // x.shape[-1], x.shape[-1]]]
    while len(merged) < 2:
        merged.insert(0, [1, 0])
    (_, stride_b), (length, stride_l) = merged
    return x, length, stride_b, stride_l


def modulation_args(m: Tensor | None, length: int) -> tuple[int, int, int, int]:
    """(stride_b, stride_g, tokens per group, stride_c) of a [Bm, G, C] modulation tensor."""
    if m is None:
        return 0, 0, 1, 0
    bm, g, c = m.shape
    bsz, gsz, csz = (m.stride(0) if bm > 1 else 0), (m.stride(1) if g > 1 else 0), m.stride(2)
    return bsz, gsz, max(1, length // g), csz if c > 1 else 0


def check_float(name: str, t: Tensor, device: torch.device) -> None:
    """TypeError unless ``t`` is a supported floating dtype; ValueError if on another device."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; expected one of float32, bfloat16, float16")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}; expected the input's device {device}")


def check_affine(weight: Tensor | None, bias: Tensor | None, c: int, device: torch.device) -> None:
    """Validate optional LayerNorm weight and bias of shape [C]."""
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        check_float(name, t, device)
        if tuple(t.shape) != (c,):
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected ({c},)")


def new_output(t: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """A fresh contiguous tensor shaped like ``t`` (the ops' outputs and their fakes)."""
    return torch.empty(t.shape, dtype=dtype or t.dtype, device=t.device)
