"""``rms_norm_scale``: diffusers' RMSNorm times a modulation scale, plus an optional shift,
rounded where the families that write it eagerly round.

Three families modulate an RMSNorm (no LayerNorm, so the ``adaln_*`` and
``layer_norm_scale_shift`` ops do not apply), each with its own roundings:

* Mochi (``MochiModulatedRMSNorm``, ``MochiRMSNormZero``): ``(rms(x.float()) * s)
  .to(x.dtype)``: the norm and the product in fp32, one rounding (``upcast=True``);
* Z-Image (``ZImageTransformerBlock``): ``attention_norm1(x) * scale``: the norm rounded
  to the weight's dtype, times the weight, times the scale, each rounded (a weight);
* LTX-Video (``LTXVideoTransformerBlock``): ``norm1(h) * (1 + c) + s``: the norm rounded,
  the product rounded, the sum rounded (a shift).

The op's meaning is those expressions, every rounding included; the ``1 + scale`` (or
``tanh``) each family computes on its ``[B, 1, C]`` modulation stays the family's.

Paths: ``cpu`` (:mod:`ditops.kernels.cpu.rms_norm_scale`: eager's operations on row
blocks in cache, bitwise the meaning in both precisions); ``cuda``/``hip``/``xpu``
through Triton (:mod:`ditops.kernels.triton.rms_norm_scale`, fast: eager's roundings,
fp32 sums in another order); NPUs run the meaning.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ditops.backends.triton import TRITON
from ditops.core.calls import OpCall
from ditops.core.checks import FLOATS, check_flag, check_tensor
from ditops.core.op import CustomOp, register_op
from ditops.core.paths import path
from ditops.core.public import public_op
from ditops.ops import qk_norm_rope_args as args
from ditops.ops.qk_norm_rope import TRITON_MAX_ROW, native_rms_norm

_OP = "rms_norm_scale"


@dataclass(slots=True)
class RMSScaleCall(OpCall):
    x: torch.Tensor  # [B, L, C]
    scale: torch.Tensor  # [C], [Bm, 1, C] or [Bm, L, C], Bm in {1, B}
    shift: torch.Tensor | None  # as scale
    weight: torch.Tensor | None  # [C]
    eps: float
    upcast: bool


def _check_rows(m: object, name: str, x: torch.Tensor) -> torch.Tensor:
    """A modulation: ``[C]``, ``[Bm, 1, C]`` or ``[Bm, L, C]`` with ``Bm`` in ``{1, B}``."""
    t = check_tensor(_OP, name, m, args.ACTIVATIONS)
    B, L, C = x.shape
    ok = (t.dim() == 1 and t.shape[0] == C) or (
        t.dim() == 3 and t.shape[0] in (1, B) and t.shape[1] in (1, L) and t.shape[2] == C
    )
    if not ok:
        raise ValueError(
            f"{_OP}: {name} of shape {list(t.shape)} does not fit x [B, L, C] = "
            f"{list(x.shape)}; expected [C], [B, 1, C] or [B, L, C] (the leading B may be 1)"
        )
    if t.device != x.device:
        raise ValueError(f"{_OP}: {name} is on {t.device} but x is on {x.device}")
    return t


def native_rms_norm_scale(
    x: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps: float,
    upcast: bool,
) -> torch.Tensor:
    n = native_rms_norm(x.to(torch.float32) if upcast else x, weight, eps, "diffusers")
    y = n * scale
    if shift is not None:
        y = y + shift
    return y.to(x.dtype) if upcast else y


def _triton_reasons(c: RMSScaleCall) -> list[str]:
    """Rows wider than the Triton kernel holds in registers."""
    C = c.x.shape[-1]
    if C > TRITON_MAX_ROW:
        return [f"rows of {C} elements: the Triton kernel holds <= {TRITON_MAX_ROW}"]
    return []


@register_op(_OP)
class RMSNormScaleOp(CustomOp):
    """diffusers' RMSNorm times a scale (plus a shift), eager's roundings; see the module."""

    def prepare(  # type: ignore[override]
        self,
        x: torch.Tensor,
        scale: torch.Tensor,
        eps: float,
        *,
        weight: torch.Tensor | None = None,
        shift: torch.Tensor | None = None,
        upcast: bool = False,
    ) -> RMSScaleCall:
        x = check_tensor(_OP, "x", x, args.ACTIVATIONS)
        if x.dim() != 3:
            raise ValueError(
                f"{_OP}: x must be [B, L, C] (batch, tokens, channels), got {list(x.shape)}"
            )
        s = _check_rows(scale, "scale", x)
        sh = None if shift is None else _check_rows(shift, "shift", x)
        args.check_weight(weight, x.shape[-1], x, _OP, "weight", "C, the last dim of x")
        e = args.resolve_eps(eps, x.dtype, "diffusers", _OP)
        return RMSScaleCall(x, s, sh, weight, e, check_flag(_OP, "upcast", upcast))

    def forward_native(self, c: RMSScaleCall) -> torch.Tensor:
        return native_rms_norm_scale(c.x, c.scale, c.shift, c.weight, c.eps, c.upcast)

    @path(precisions=("exact", "fast"), dtypes=FLOATS, inference_only=True, fast_bits="native")
    def forward_cpu(self, c: RMSScaleCall) -> torch.Tensor:  # the meaning's bits in both
        from ditops.kernels.cpu.rms_norm_scale import rms_norm_scale as kernel

        return kernel(c.x, c.scale, c.shift, c.weight, c.eps, c.upcast)

    @path("cuda", "hip", "xpu", backend=TRITON, dtypes=FLOATS, inference_only=True,
          reasons=_triton_reasons)  # fmt: skip
    def forward_cuda(self, c: RMSScaleCall) -> torch.Tensor:
        from ditops.kernels.triton.rms_norm_scale import rms_norm_scale as kernel

        return kernel(c.x, c.scale, c.shift, c.weight, c.eps, c.upcast)


@public_op(RMSNormScaleOp())
def rms_norm_scale(
    x: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    *,
    weight: torch.Tensor | None = None,
    shift: torch.Tensor | None = None,
    upcast: bool = False,
) -> torch.Tensor:
    """diffusers' RMSNorm of ``x`` times ``scale`` (plus ``shift``), rounded as eager rounds.

    Meaning (``rms`` is diffusers' ``RMSNorm`` without bias: ``x * rsqrt(mean(x.float()^2)
    + eps)`` in fp32; no weight: rounded to the input's dtype; a bf16/fp16 weight: rounded
    to its dtype, then times it; an fp32 weight: times it in fp32)::

        xin = x.float() if upcast else x
        y = rms(xin, weight, eps) * scale          # torch's type promotion
        if shift is not None:
            y = y + shift
        return y.to(x.dtype) if upcast else y

    Mochi's modulated norms are ``upcast=True`` (``(rms(x.float()) * s).to(x.dtype)``);
    Z-Image's ``attention_norm1(x) * scale_msa`` gives the weight; LTX-Video's
    ``norm1(h) * (1 + c) + s`` the shift (``scale = 1 + c``, computed by the caller).

    Shapes and dtypes:
        x: ``[B, L, C]``, fp32/bf16/fp16 (fp64 runs the meaning).
        scale: ``[C]``, ``[B, 1, C]`` (per sample) or ``[B, L, C]`` (per token), the
            leading B may be 1; any float dtype (promoted as eager promotes).
        eps: diffusers' RMSNorm's epsilon (it has no default), a positive float.
        weight: the norm's ``[C]`` weight or None.
        shift: None or shaped as ``scale``.
        upcast: norm ``x.float()`` and round the result once to x's dtype (Mochi).

    Returns x's shape; dtype: x's with ``upcast``, else eager's promotion of the norm's
    dtype (x's, or a weight's) with the scale's (and the shift's).

    Precision: the CPU path is bitwise the meaning in ``exact`` and ``fast`` alike (it
    runs eager's operations on row blocks). The Triton path is ``fast``: eager's
    roundings with another fp32 summation order (fp32 outputs within rtol 1e-5, bf16/fp16
    within 1 ulp, as :func:`rms_norm`'s). NaN and inf propagate as in the meaning.
    """
