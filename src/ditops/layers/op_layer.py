"""What the norm modules share: a ``precision`` of their own and running their op on a
prepared call (:class:`~ditops.layers.norm.FP32LayerNorm`,
:class:`~ditops.layers.rms_norm.RMSNorm`)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ditops.core.checks import check_precision
from ditops.core.op import CustomOp
from ditops.core.paths import Decision


class OpLayer:
    """Mixin for an ``nn.Module`` that runs one op: ``op`` (the op), ``_call(x)`` (the op's
    prepared call for input ``x``) and ``layer_name`` (for messages) come from the class.
    ``precision`` (``"exact"``/``"fast"``/None) is this module's; None follows the process
    setting."""

    op: ClassVar[CustomOp]
    layer_name: ClassVar[str]
    _precision: str | None = None  # a class default: modules swapped in place have none set

    @property
    def precision(self) -> str | None:
        return self._precision

    @precision.setter
    def precision(self, value: str | None) -> None:
        self._precision = check_precision(value, f"{self.layer_name}.precision")

    def _call(self, x: torch.Tensor) -> Any:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op.run(self._call(x), self._precision)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """The meaning, whatever the settings (for comparisons)."""
        return self.op.forward_native(self._call(x))

    def explain_call(self, x: torch.Tensor) -> Decision:
        """The path :meth:`forward` would take for ``x``, with reasons."""
        return self.op.explain_prepared(self._call(x), self._precision)
