"""The norm swap every family uses, and the generic family for models ditops has no
deeper patch for (FLUX, HunyuanVideo, ... today).

``FP32LayerNorm`` modules (diffusers' or any ``nn.LayerNorm`` subclass named so) become
ditops' :class:`~ditops.layers.norm.FP32LayerNorm` in place (see :func:`swap_norms`).
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ditops.integrations.shared.base import (
    AttrSet,
    ClassSwap,
    PatchOptions,
    PatchRecord,
    refuse_sparse,
)
from ditops.integrations.shared.guard import attached_to, own_forward_left
from ditops.layers.norm import FP32LayerNorm


class ModelDtypeLayerNorm(FP32LayerNorm):
    """A plain ``nn.LayerNorm`` patched with ``precision=None``: its own arithmetic (the
    model dtype) whenever the precision in force (``DITOPS_PRECISION``, ``configure``,
    ``override``) is exact, FP32LayerNorm's in fast, decided per call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.resolved_precision() == "exact":
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return super().forward(x)


def _is_fp32_layer_norm(m: nn.Module) -> bool:
    return isinstance(m, nn.LayerNorm) and type(m).__name__ == "FP32LayerNorm"


def swap_norms(model: nn.Module, record: PatchRecord, precision: str | None) -> None:
    """Make FP32LayerNorm modules (and plain nn.LayerNorms, but in exact precision) ditops'
    norms, in place: each keeps its identity, parameters and hooks; its class changes.

    Plain ``nn.LayerNorm`` computes in the model dtype: in ``fast`` it becomes an
    FP32LayerNorm (fp32 inside, within tolerance), with ``precision=None`` a
    :class:`ModelDtypeLayerNorm` (its own arithmetic whenever exact is in force), in
    ``exact`` it stays. A norm whose forward diffusers or accelerate hooks wrap (offloading,
    caching) stays as it is: those wrappers hold its class's forward, so ditops' would not
    run under them.
    """
    for module in model.modules():
        if isinstance(module, FP32LayerNorm):
            continue
        if _is_fp32_layer_norm(module):
            new: type | None = FP32LayerNorm
        elif type(module) is nn.LayerNorm:
            new = {"fast": FP32LayerNorm, None: ModelDtypeLayerNorm}.get(precision)
        else:
            new = None
        if new is None:
            continue
        what = attached_to(module)
        if what is not None and "torch forward hook" not in what:
            record.count("norms kept (hooked)")
            continue
        # A removed hook leaves the class's forward bound on the instance (own_forward_left)
        left = own_forward_left(module, vars(module).get("forward"))
        change = ClassSwap(module, type(module), new, precision)
        change.redo()
        record.add(change)
        if left:
            # bind the new class's forward there instead, or the swap would not run
            record.add(AttrSet.apply(module, "forward", types.MethodType(new.forward, module)))
        record.count("norms")


def has_swappable_norms(model: nn.Module) -> bool:
    """Whether :func:`swap_norms` has anything to act on in some precision (an
    FP32LayerNorm, diffusers' or ditops', or a plain ``nn.LayerNorm``)."""
    return any(
        isinstance(m, FP32LayerNorm) or _is_fp32_layer_norm(m) or type(m) is nn.LayerNorm
        for m in model.modules()
    )


class GenericFamily:
    """Any model: norms only."""

    name = "generic"
    summary = "norms only"
    model_classes: tuple[str, ...] = ()  # any model
    sparse_attention = False

    def recognise(self, model: nn.Module) -> bool:
        return True

    def check(self, model: nn.Module, options: PatchOptions) -> None:
        if options.attention is not None:
            refuse_sparse(model, "norms")

    def apply(
        self, model: nn.Module, plan: Any, record: PatchRecord, options: PatchOptions
    ) -> None:
        if options.norms:
            swap_norms(model, record, options.precision)
