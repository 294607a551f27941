"""The attention prologue on Ascend NPUs: ``torch_npu.npu_rms_norm`` and ``npu_rotary_mul``.

What the two torch_npu functions are documented to do, and how the ops use them
(``fast`` precision only; ``exact`` runs the meaning):

``torch_npu.npu_rms_norm(self, gamma, epsilon=1e-6) -> (y, rstd)``
    ``y = x / sqrt(mean(x^2) + eps) * gamma``; ``rstd`` fp32. Inputs fp16, bf16 or fp32;
    the torch_npu reference asks for ``gamma`` in ``self``'s dtype (only newer CANN's
    aclnnRmsNorm also lists bf16/fp16 ``x`` with an fp32 ``gamma``, so ditops never
    passes a mixed pair). CANN's kernel and its golden reference compute in fp32:
    ``x32 * rstd * gamma32``, rounded **once** to ``x``'s dtype (``1 / sqrt`` of
    ``sum * (1/n) + eps``, its own summation order): torch 2.13's ``F.rms_norm``
    arithmetic up to fp32 rounding, i.e. the ``rms_norm`` fast contract. Used as:

    * ``torch`` convention, weight None or in x's dtype: one call (None: a weight of ones,
      exact in every dtype);
    * a weight of another dtype (an fp32 weight on bf16 activations): one call on
      ``x.float()`` with ``weight.float()`` (fp32/fp32, documented), rounded once to the
      output dtype: the same arithmetic at the cost of two casts;
    * ``diffusers`` convention: the same normalisation rounded to the weight's dtype,
      then multiplied by a bf16/fp16 weight in that dtype (torch's elementwise multiply,
      as eager does), or left in fp32 with an fp32 weight.

    Rows are passed as ``[rows, N]`` (older releases document 2-8 dims).

``torch_npu.npu_rotary_mul(input, r1, r2, rotary_mode='half') -> Tensor``
    ``r1 * x + r2 * rotate(x)``, ``rotate`` over halves (``'half'``: diffusers'
    ``use_real_unbind_dim=-2``) or interleaved pairs (``'interleave'``, newer torch_npu:
    ``use_real_unbind_dim=-1`` and Wan). 4-D inputs of fp16/bf16/fp32; output in
    ``input``'s dtype. Its internal precision for bf16/fp16 inputs is not documented, so
    ditops only calls it in fp32: x widened (a no-op for fp32), full-width fp32 tables
    ``[Bt, L, 1, D]``, the result rounded once to x's dtype, which is the meaning's
    arithmetic (products and sum in fp32, one rounding) up to the kernel's own fp32
    rounding. Documented limits for our ``[B, L, H, D]`` (BSND) layout, A2/A3
    (``jit_compile=False``): ``D < 896`` and even; ``'half'``: ``B, H < 1000``, tables
    ``1S1D`` or ``BS1D``; ``'interleave'``: ``B * H < 1000``, tables ``1S1D`` only; both:
    tables within ``[-1, 1]``. (Older releases and Atlas training/inference cards,
    ``jit_compile=True``: ``'half'`` only, ``D == 128``; there a call outside that raises
    inside torch_npu, and the dispatcher gives the path up with one warning.)

Calls outside these contracts run the meaning, each with its reason
(:func:`npu_norm_reasons`, :func:`npu_rotary_reasons` below): a rotation the meaning
computes in bf16/fp16
(Wan cast to bf16 with ``.to(bf16)`` keeps bf16 tables; eager rounds every product),
head dims of 896 or more, too many batches/heads, per-batch tables in interleaved
layout, tables outside ``[-1, 1]`` (checked per call outside ``torch.compile``: one
small reduction of the tables), empty inputs.

Sources (read 2026-12): torch_npu API reference, ``torch_npu.npu_rms_norm`` and
``torch_npu.npu_rotary_mul`` (hiascend.com/document/detail/zh/Pytorch/700/apiref/apilist/
ptaoplist_000860.html and ptaoplist_000141.html; gitcode.com/Ascend/op-plugin
docs/context/torch_npu-npu_rotary_mul.md); CANN ops-nn ``norm/rms_norm``
(docs/aclnnRmsNorm.md: dtype table, Inf/NaN behaviour on A2/A3; op_kernel/rms_norm.h and
tests/assets/golden.py: fp32 compute, one cast of the output); aclnnRotaryPositionEmbedding
and MindSpore's ``ops.rotary_position_embedding`` (same kernel: cos/sin in x's dtype,
layout table per mode).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ditops.tracing import traced

Fn = Callable[..., Any]


# --- the calls -------------------------------------------------------------------------------


def _normalise(
    npu_rms_norm: Fn,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``(x32 * rstd * weight32)`` rounded once to ``out_dtype``, over x's last dim."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    if x.dtype == out_dtype and (weight is None or weight.dtype == x.dtype):
        gamma = torch.ones(n, dtype=x.dtype, device=x.device) if weight is None else weight
        y: torch.Tensor = npu_rms_norm(rows, gamma, eps)[0]
        return y.reshape(x.shape)
    # fp32 in, fp32 out (documented for every release), then one rounding.
    gamma = torch.ones(n, device=x.device) if weight is None else weight.float()
    y = npu_rms_norm(rows.float(), gamma, eps)[0]
    return y.to(out_dtype).reshape(x.shape)


def rms_norm(
    npu_rms_norm: Fn,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    convention: str,
) -> torch.Tensor:
    """The ``rms_norm`` op (either convention) through ``npu_rms_norm``."""
    if convention == "torch" or weight is None:
        return _normalise(npu_rms_norm, x, weight, eps, x.dtype)
    if weight.dtype == torch.float32:  # diffusers: multiplied in fp32, not rounded back
        return _normalise(npu_rms_norm, x, weight, eps, torch.float32)
    # diffusers with a bf16/fp16 weight: rounded to its dtype, then multiplied in it
    return _normalise(npu_rms_norm, x, None, eps, weight.dtype) * weight


def full_tables(t3: torch.Tensor, D: int, layout: str) -> torch.Tensor:
    """``[Bt, L, Dt]`` -> contiguous fp32 ``[Bt, L, 1, D]``: one entry per element."""
    if t3.shape[-1] != D:
        t3 = t3.repeat_interleave(2, -1) if layout == "interleaved" else torch.cat([t3, t3], -1)
    return t3.unsqueeze(2).float().contiguous()


def rotary(
    npu_rotary_mul: Fn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str
) -> torch.Tensor:
    """``x`` [B, L, H, D] rotated in fp32 with full-width fp32 tables, rounded once."""
    x32 = x.float().contiguous()
    if layout == "halves":
        out: torch.Tensor = npu_rotary_mul(x32, cos, sin)  # the default mode, every release
    else:
        out = npu_rotary_mul(x32, cos, sin, rotary_mode="interleave")
    return out.to(x.dtype)


def qk_norm_rope(
    npu_rms_norm: Fn,
    npu_rotary_mul: Fn,
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos3: torch.Tensor,
    sin3: torch.Tensor,
    eps: float,
    across_heads: bool,
    layout: str,
    convention: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm (per head or across heads) then rotation, the two torch_npu calls composed.

    The normalised value is rounded where eager rounds it, so each output is within the
    ``rms_norm`` tolerance of eager's normalised value, rotated as the meaning rotates.
    """
    B, L, H, D = q.shape
    cos, sin = full_tables(cos3, D, layout), full_tables(sin3, D, layout)

    def one(x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(B, L, H * D) if across_heads else x
        normed = rms_norm(npu_rms_norm, rows, w, eps, convention).reshape(B, L, H, D)
        return rotary(npu_rotary_mul, normed, cos, sin, layout)

    return one(q, q_weight), one(k, k_weight)


# --- what the two functions are documented to take: the NPU paths' reasons ---------------

#: ``npu_rotary_mul``: head dims below this (and even).
NPU_MAX_HEAD_DIM = 896
#: ``'half'``: batch and heads each below this; ``'interleave'``: their product.
NPU_MAX_BATCH_HEADS = 1000


def npu_norm_reasons(x: torch.Tensor) -> list[str]:
    """Why ``npu_rms_norm`` cannot take these activations."""
    if x.numel() == 0:
        return ["an empty input: torch_npu.npu_rms_norm takes no empty weight"]
    return []


def npu_rotary_reasons(
    x: torch.Tensor, cos3: torch.Tensor, sin3: torch.Tensor, layout: str, compute: torch.dtype
) -> list[str]:
    """Why ``npu_rotary_mul`` cannot rotate ``x`` [B, L, H, D] (normalised, for the fused
    op) with ``[Bt, L, Dt]`` tables as the meaning does (in ``compute``)."""
    B, _, H, D = x.shape
    reasons = []
    if compute != torch.float32:
        reasons.append(
            f"the rotation is computed in {str(compute).removeprefix('torch.')} (tables in "
            "the activations' "
            "low-precision dtype, rounding every product); torch_npu.npu_rotary_mul does not "
            "document its internal precision and is called in fp32 only"
        )
    if D >= NPU_MAX_HEAD_DIM:
        reasons.append(f"head dim {D}: torch_npu.npu_rotary_mul takes D < {NPU_MAX_HEAD_DIM}")
    if layout == "halves" and (B >= NPU_MAX_BATCH_HEADS or H >= NPU_MAX_BATCH_HEADS):
        reasons.append(
            f"batch {B}, heads {H}: torch_npu.npu_rotary_mul ('half') takes each "
            f"< {NPU_MAX_BATCH_HEADS}"
        )
    if layout == "interleaved" and B * H >= NPU_MAX_BATCH_HEADS:
        reasons.append(
            f"batch x heads = {B * H}: torch_npu.npu_rotary_mul ('interleave') takes "
            f"< {NPU_MAX_BATCH_HEADS}"
        )
    if layout == "interleaved" and cos3.shape[0] != 1:
        reasons.append(
            "per-batch tables: torch_npu.npu_rotary_mul ('interleave') takes [1, L, 1, D] "
            "tables only"
        )
    if x.numel() == 0:
        reasons.append("an empty input: torch_npu.npu_rotary_mul takes positive dims only")
    if not reasons and not traced() and not _unit_range(cos3, sin3):
        reasons.append(
            "cos/sin outside [-1, 1]: torch_npu.npu_rotary_mul documents tables within it"
        )
    return reasons


def _unit_range(cos3: torch.Tensor, sin3: torch.Tensor) -> bool:
    return bool(((cos3.abs() <= 1).all() & (sin3.abs() <= 1).all()).item())
