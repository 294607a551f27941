"""The modulation modules users put in DiT models: a LayerNorm's parameters, modulated.

:class:`LayerNormScaleShift` and :class:`ScaleResidualLayerNormScaleShift` hold a norm's
``weight``/``bias`` under the same state-dict keys as ``nn.LayerNorm`` (and diffusers'
``FP32LayerNorm``), so they replace such a norm in a loaded model; ``from_module(norm)``
converts one keeping its parameters. They run Wan's chain, the ops of
:mod:`ditops.ops.modulation_fp32` (their meaning, paths and precision contract are there).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from ditops.core.checks import as_int, check_eps, check_precision
from ditops.core.op import CustomOp
from ditops.ops.modulation_args import ModulationArg
from ditops.ops.modulation_fp32 import (
    DEFAULT_EPS,
    LayerNormScaleShiftOp,
    ScaleResidualLayerNormScaleShiftOp,
)


class _NormParams(nn.Module):
    """``nn.LayerNorm``'s parameters and settings, under the same state-dict keys.

    ``precision`` (``"exact"``/``"fast"``/None) overrides the process setting for this
    module; None follows ``DITOPS_PRECISION``.
    """

    op_class: ClassVar[type[CustomOp]]

    def __init__(
        self,
        normalized_shape: int | list[int] | tuple[int, ...] | torch.Size,
        eps: float = DEFAULT_EPS,
        elementwise_affine: bool = True,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        precision: str | None = None,
    ) -> None:
        super().__init__()
        check_precision(precision)
        name = type(self).__name__
        single = as_int(normalized_shape)
        if single is not None:
            shape: tuple[int, ...] = (single,)
        elif isinstance(normalized_shape, (list, tuple, torch.Size)):
            shape = tuple(as_int(c) for c in normalized_shape)  # type: ignore[misc]
        else:
            shape = ()
        if len(shape) != 1 or shape[0] is None or shape[0] < 1:
            raise ValueError(
                f"{name} normalises the last dim only; normalized_shape must be one int "
                f"C >= 1 (or [C]), got {normalized_shape!r}"
            )
        self.normalized_shape = shape
        self.eps = check_eps(name, eps)
        self.elementwise_affine = elementwise_affine
        kw = {"device": device, "dtype": dtype}
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(shape, **kw))
            self.bias = nn.Parameter(torch.zeros(shape, **kw)) if bias else None
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        # The module's own op instance, so ``precision`` is per module.
        self.op = self.op_class()
        self.op.precision = precision

    @classmethod
    def from_module(cls, module: nn.LayerNorm, precision: str | None = None) -> Any:
        """A module sharing ``module``'s parameters (no copy), eps and affine settings.

        Takes ``nn.LayerNorm`` and its subclasses (diffusers' and ditops' FP32LayerNorm).
        """
        if not isinstance(module, nn.LayerNorm):
            raise TypeError(f"from_module expects an nn.LayerNorm, got {type(module).__name__}")
        new = cls(
            module.normalized_shape, module.eps, elementwise_affine=False, precision=precision
        )
        new.elementwise_affine = module.elementwise_affine
        new.weight = module.weight
        new.bias = module.bias
        new.train(module.training)
        return new

    def extra_repr(self) -> str:
        return (
            f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
        )


class LayerNormScaleShift(_NormParams):
    """A LayerNorm in fp32 followed by ``* (1 + scale) + shift``, rounded once.

    Stands in for an ``nn.LayerNorm`` / ``FP32LayerNorm`` (same constructor, same
    ``weight``/``bias`` state-dict keys). ``forward(x, scale, shift, out_dtype=None)``.
    """

    op_class = LayerNormScaleShiftOp

    def forward(
        self,
        x: torch.Tensor,
        scale: ModulationArg = None,
        shift: ModulationArg = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        return self.op(x, self.weight, self.bias, scale, shift, self.eps, out_dtype)


class ScaleResidualLayerNormScaleShift(_NormParams):
    """The gated residual, then the modulated fp32 LayerNorm of its result, in one pass.

    ``forward(residual, x, gate=1, scale=None, shift=None, out_dtype=None)`` returns
    ``(modulated, new_residual)``. Holds the norm's parameters like ``nn.LayerNorm``.
    """

    op_class = ScaleResidualLayerNormScaleShiftOp

    def forward(
        self,
        residual: torch.Tensor,
        x: torch.Tensor,
        gate: ModulationArg = 1,
        scale: ModulationArg = None,
        shift: ModulationArg = None,
        out_dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.op(residual, x, gate, self.weight, self.bias, scale, shift, self.eps, out_dtype)
