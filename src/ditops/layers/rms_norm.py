"""RMSNorm: a stand-in for ``torch.nn.RMSNorm`` or diffusers' ``RMSNorm`` (without bias).

The module users put in models; it runs the op :data:`ditops.ops.qk_norm_rope.rms_norm`
(its two conventions, paths and precision contract are there).
"""

from __future__ import annotations

import torch
from torch import nn

from ditops.core.checks import as_int, check_choice, check_eps
from ditops.layers.op_layer import OpLayer
from ditops.ops.qk_norm_rope import rms_norm
from ditops.ops.qk_norm_rope_args import CONVENTIONS, NormCall


class RMSNorm(OpLayer, nn.Module):
    """An RMSNorm over the last dim, in ``torch.nn.RMSNorm``'s or diffusers' arithmetic.

    Same state-dict key as both (``weight``). ``from_module`` converts a
    ``torch.nn.RMSNorm`` (convention ``"torch"``) or a diffusers ``RMSNorm`` without bias
    (``"diffusers"``), sharing its parameter. ``precision`` (``"exact"``/``"fast"``/None)
    overrides the process setting for this module.
    """

    op = rms_norm.op
    layer_name = "RMSNorm"

    def __init__(
        self,
        dim: int,
        eps: float | None = None,
        elementwise_affine: bool = True,
        convention: str = "torch",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        precision: str | None = None,
    ) -> None:
        super().__init__()
        self.precision = precision
        size = as_int(dim)
        if size is None or size < 1:
            raise ValueError(f"RMSNorm: dim must be an int >= 1, got {dim!r}")
        self.dim = size
        self.eps = None if eps is None else check_eps("RMSNorm", eps)
        self.convention = str(check_choice("RMSNorm", "convention", convention, CONVENTIONS))
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(self.dim, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)

    @classmethod
    def from_module(cls, module: nn.Module, precision: str | None = None) -> RMSNorm:
        """An RMSNorm sharing ``module``'s weight and eps (torch's or diffusers' RMSNorm)."""
        if isinstance(module, nn.RMSNorm):
            shape = tuple(module.normalized_shape)
            convention = "torch"
        elif type(module).__name__ == "RMSNorm" and type(module).__module__.startswith(
            "diffusers."
        ):
            shape = tuple(module.dim)
            convention = "diffusers"
            if getattr(module, "bias", None) is not None:
                raise ValueError(
                    "RMSNorm.from_module: diffusers RMSNorm with a bias is not supported; "
                    "expected bias=None"
                )
        else:
            raise TypeError(
                "RMSNorm.from_module expects a torch.nn.RMSNorm or a diffusers RMSNorm, got "
                f"{type(module).__module__}.{type(module).__name__}"
            )
        if len(shape) != 1:
            raise ValueError(
                f"RMSNorm.from_module: normalises the last dim only; expected one dim, got {shape}"
            )
        new = cls(
            shape[0],
            module.eps,
            elementwise_affine=False,
            convention=convention,
            precision=precision,
        )
        new.elementwise_affine = module.weight is not None
        new.weight = module.weight
        new.train(module.training)
        return new

    def _call(self, x: torch.Tensor) -> NormCall:
        return rms_norm.op.prepare(x, self.weight, self.eps, self.convention)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, convention={self.convention!r}"
