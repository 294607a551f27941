"""``gelu_tanh_bias``: the tanh GELU of ``x + bias``, the feed-forward activation of Wan and FLUX.

Meaning (``forward_native``), in x's dtype::

    F.gelu((x + bias).to(x.dtype), approximate="tanh")   # bias None: F.gelu(x, ...)

diffusers' ``GELU(approximate="tanh")`` computes ``F.gelu(proj(h), approximate="tanh")``
with ``proj`` a biased Linear; running the Linear without its bias and then this op
makes the bias add and the activation one pass over the ``[tokens, ffn_dim]``
activations instead of two. ``.to`` matters only for an fp32 bias with low-precision x.

Paths: ``cuda``/``hip``/``xpu`` through one Triton pass (fast; exact runs native; NaN and
inf propagate as in the meaning). No CPU path: there the activation costs about 3x a copy
(compute-bound), so blocking eager's two ATen calls to save a pass gained nothing
(``benchmarks/cpu/probes/gelu.txt``): CPU runs the meaning.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ditops.backends.triton import TRITON
from ditops.core.calls import OpCall
from ditops.core.checks import FLOATS, check_tensor
from ditops.core.op import CustomOp, register_op
from ditops.core.paths import path
from ditops.core.public import public_op

OP = "gelu_tanh_bias"


@dataclass(slots=True)
class GeluCall(OpCall):
    x: torch.Tensor
    bias: torch.Tensor | None  # [C], x's dtype or fp32


@register_op(OP)
class GeluTanhBiasOp(CustomOp):
    """``gelu_tanh_bias(x, bias=None)``; see the module docstring."""

    def prepare(  # type: ignore[override]
        self, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> GeluCall:
        check_tensor(OP, "x", x)
        if bias is None:
            return GeluCall(x, None)
        allowed = tuple(dict.fromkeys((x.dtype, torch.float32)))
        check_tensor(OP, "bias", bias, allowed)
        if x.dim() == 0 or tuple(bias.shape) != (x.shape[-1],):
            want = f"({x.shape[-1]},)" if x.dim() else "None (x is a scalar)"
            raise ValueError(
                f"{OP}: bias of shape {tuple(bias.shape)} does not fit x of shape "
                f"{tuple(x.shape)}; expected a 1-D bias of x's last dim: {want}"
            )
        if bias.device != x.device:
            raise ValueError(f"{OP}: bias is on {bias.device}; expected x's device {x.device}")
        return GeluCall(x, bias)

    def forward_native(self, c: GeluCall) -> torch.Tensor:
        h = c.x if c.bias is None else (c.x + c.bias).to(c.x.dtype)
        return F.gelu(h, approximate="tanh")

    @path("cuda", "hip", "xpu", backend=TRITON, dtypes=FLOATS, inference_only=True,
          propagates_non_finite=True)  # fmt: skip
    def forward_cuda(self, c: GeluCall) -> torch.Tensor:
        from ditops.kernels.triton.gelu import gelu_tanh_bias

        return gelu_tanh_bias(c.x, c.bias)


@public_op(GeluTanhBiasOp())
def gelu_tanh_bias(x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The tanh GELU of ``x + bias``: a biased Linear's activation in one pass (Wan, FLUX).

    Meaning::

        F.gelu((x + bias).to(x.dtype), approximate="tanh")  # bias None: F.gelu(x)

    Run the Linear without its bias (``F.linear(h, proj.weight)``), then this op with
    ``proj.bias``: the add and the activation are one pass over the activations.

    Shapes and dtypes:
        x: any shape, a floating dtype (fp32, bf16, fp16).
        bias: ``[C]`` with ``C = x.shape[-1]``, x's dtype or fp32, on x's device; None:
            no bias.

    Returns a tensor shaped and typed like ``x``.

    Precision: ``exact`` runs the meaning; ``fast`` (Triton) is within 1 ulp of the output
    dtype of it (tiny outputs of very negative inputs, where eager's ``1 + tanh`` cancels:
    within ``|x + bias| * 2**-23`` absolute). NaN and inf propagate as in the meaning.
    """
