"""ditops' forwards for more of sglang's ``CustomOp`` classes, each against the op's own
``forward_native`` (the meaning; ``tests/sglang/test_elementwise.py`` measures them):

* ``MulAdd`` (``c + a * (k + b)``; Wan, HunyuanVideo, Qwen-Image, causal Wan):
  ``k + b`` as sglang computes it, then :data:`ditops.adaln_residual` (``residual + gate
  * x``: the product rounded to the promoted dtype, then the sum: eager's two steps in
  one pass). Bitwise sglang's expression, per-frame ``[B, F, 1, C]`` included.
* ``RMSNormNoWeight`` (LTX-2; ``F.rms_norm(x, eps=eps)``): :data:`ditops.rms_norm`
  without a weight (torch convention): bitwise in ``exact``, ditops' fast contract
  (1 ulp) in ``fast``.
* ``RMSNormScaleShift`` / ``ScaleResidualRMSNormScaleShift``: sglang's CPU forward
  calls a CPU build of sgl-kernel no registry serves (and the native one of the latter
  reaches it through its NPU probe); here they run sglang's native composition (the
  gated sum; ``fuse_scale_shift_kernel`` read as its plain-torch fallback, or
  ``normalized * (1 + scale) + shift``), the inner ``RMSNorm`` ditops' (:mod:`.norms`):
  bitwise sglang's native expression where that runs (fp32, and ``exact``).
* ``GeluAndMul(approximate="tanh")`` and ``NewGELU``: :data:`ditops.gelu_tanh_bias`
  (``F.gelu(x, approximate="tanh")``). ``GeluAndMul`` tanh is bitwise sglang's;
  ``NewGELU`` writes the same function as ``0.5 x (1 + tanh(c (x + 0.044715 x^3)))``
  in separate roundings; torch's fused tanh GELU is within 2 ulps of it at the magnitude
  ``|GELU(x)| + |x| / 2`` (the spelled form's own rounding of ``1 + tanh`` for x << 0,
  where torch 2.14's fused GELU gives 0), fp32 and bf16 (measured in the test).
  ``GeluAndMul(approximate="none")`` and ``SiluAndMul`` keep sglang's forward: ditops
  has no op for them.

A call ditops' op refuses runs sglang's ``forward_native`` with one warning naming why.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ditops.ops.gelu import gelu_tanh_bias
from ditops.ops.modulation_model_dtype import adaln_residual
from ditops.ops.qk_norm_rope import rms_norm

log = logging.getLogger(__name__)
_warned: set[str] = set()


def _refused(op: str, error: Exception) -> None:
    if op not in _warned:
        _warned.add(op)
        log.warning("ditops: %s runs sglang's own expression: ditops refused (%s)", op, error)


def mul_add_forward(
    module: Any, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, k: int = 0
) -> torch.Tensor:
    """``MulAdd.forward``: ``c + a * (k + b)`` through :data:`ditops.adaln_residual`."""
    gate = k + b
    try:  # per-frame gates [B, F, 1, C] against a [B, F * S, C] stream included
        return adaln_residual(c, a, gate)
    except (TypeError, ValueError) as error:
        _refused("MulAdd", error)
        return module.forward_native(a, b, c, k)


def rms_norm_no_weight_forward(module: Any, x: torch.Tensor, eps: float) -> torch.Tensor:
    """``RMSNormNoWeight.forward`` through :data:`ditops.rms_norm` (no weight)."""
    return rms_norm(x, None, eps)


def rms_norm_scale_shift_forward(
    module: Any, x: torch.Tensor, shift: Any, scale: Any
) -> torch.Tensor:
    """``RMSNormScaleShift.forward``: ditops' RMSNorm, sglang's plain-torch modulation."""
    from sglang.kernels.ops.diffusion.common.fallback_torch import fuse_scale_shift_kernel_native

    return fuse_scale_shift_kernel_native(module.norm(x), scale, shift).to(x.dtype)


def scale_residual_rms_norm_scale_shift_forward(
    module: Any, residual: torch.Tensor, x: torch.Tensor, gate: Any, shift: Any, scale: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """``ScaleResidualRMSNormScaleShift.forward``: sglang's native composition (its gated
    sum, ditops' RMSNorm, ``normalized * (1 + scale) + shift``)."""
    from ditops.integrations.sglang.norms import gated_sum

    h = gated_sum(residual, x, gate)
    return module.norm(h) * (1 + scale) + shift, h


def gelu_and_mul_forward(module: Any, x: torch.Tensor) -> torch.Tensor:
    """``GeluAndMul.forward``: the tanh GELU half through :data:`ditops.gelu_tanh_bias`."""
    if module.approximate != "tanh":
        return module.forward_native(x)
    d = x.shape[-1] // 2
    return gelu_tanh_bias(x[..., :d]) * x[..., d:]


def new_gelu_forward(module: Any, x: torch.Tensor) -> torch.Tensor:
    """``NewGELU.forward`` through :data:`ditops.gelu_tanh_bias` (see the docstring)."""
    return gelu_tanh_bias(x)
