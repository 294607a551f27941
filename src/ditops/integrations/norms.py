"""The norm swap every family uses, and the generic family for models ditops has no
deeper patch for (FLUX, HunyuanVideo, ... today).

``FP32LayerNorm`` modules (diffusers' or any ``nn.LayerNorm`` subclass named so) become
ditops' :class:`~ditops.layers.norm.FP32LayerNorm`, sharing their parameters. Plain
``nn.LayerNorm`` modules, which compute in the model dtype, are swapped only in ``fast``
precision, where fp32 inside stays within tolerance; in ``exact`` they stay (ditops'
meaning is not theirs bit for bit).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ditops.integrations.base import ModuleSwap, PatchError, PatchOptions, PatchRecord
from ditops.layers.norm import FP32LayerNorm


def _is_fp32_layer_norm(m: nn.Module) -> bool:
    return isinstance(m, nn.LayerNorm) and type(m).__name__ == "FP32LayerNorm"


def swap_norms(model: nn.Module, record: PatchRecord, precision: str | None) -> None:
    """Replace FP32LayerNorm (and, in fast precision, nn.LayerNorm) modules by ditops'."""
    plain_too = (precision or "fast") == "fast"
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, FP32LayerNorm):
                continue
            if _is_fp32_layer_norm(child) or (plain_too and type(child) is nn.LayerNorm):
                new = FP32LayerNorm.from_module(child)  # type: ignore[arg-type]
                new.precision = precision
                setattr(parent, name, new)
                record.add(ModuleSwap(parent, name, child))
                record.count("norms")


class GenericFamily:
    """Any model: norms only."""

    name = "generic"

    def recognise(self, model: nn.Module) -> bool:
        return True

    def check(self, model: nn.Module, options: PatchOptions) -> None:
        if options.attention is not None:
            raise PatchError(
                "sparse attention is supported for WanTransformer3DModel and "
                "HunyuanVideo(15)Transformer3DModel, not for "
                f"{type(model).__name__}; call patch(..., attention=None) to patch its norms only"
            )

    def apply(
        self, model: nn.Module, plan: Any, record: PatchRecord, options: PatchOptions
    ) -> None:
        if options.norms:
            swap_norms(model, record, options.precision)
