"""FP32LayerNorm: low-precision in and out, fp32 inside; a drop-in for ``nn.LayerNorm``.

The module users put in models; it runs the op :data:`ditops.ops.layer_norm.fp32_layer_norm`
(its meaning, paths and precision contract are there).
"""

from __future__ import annotations

import torch
from torch import nn

from ditops.layers.op_layer import OpLayer
from ditops.ops.layer_norm import fp32_layer_norm


class FP32LayerNorm(OpLayer, nn.LayerNorm):
    """LayerNorm computed in fp32 and returned in the input's dtype.

    Takes ``nn.LayerNorm``'s constructor arguments and state dict (``weight``/``bias``),
    is an ``nn.LayerNorm``, and loads the state dicts of ``nn.LayerNorm`` and of
    diffusers' ``FP32LayerNorm``. Use :meth:`from_module` to convert an existing norm
    while keeping its parameters. ``precision`` (``"fast"``/``"exact"``/None) is this
    module's; None follows ``DITOPS_PRECISION``.
    """

    op = fp32_layer_norm.op
    layer_name = "FP32LayerNorm"

    def resolved_precision(self) -> str:
        """The precision in force for this module: its own, else the process setting."""
        return (
            fp32_layer_norm.op.resolved_precision() if self._precision is None else self._precision
        )

    @classmethod
    def from_module(cls, module: nn.LayerNorm) -> FP32LayerNorm:
        """An FP32LayerNorm sharing ``module``'s parameters (no copy) and settings."""
        if not isinstance(module, nn.LayerNorm):
            raise TypeError(f"from_module expects an nn.LayerNorm, got {type(module).__name__}")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.normalized_shape = tuple(module.normalized_shape)
        new.eps = module.eps
        new.elementwise_affine = module.elementwise_affine
        new.weight = module.weight
        new.bias = module.bias
        new.train(module.training)
        return new

    def _call(self, x: torch.Tensor):
        return fp32_layer_norm.op.prepare(
            x, tuple(self.normalized_shape), self.weight, self.bias, self.eps
        )
