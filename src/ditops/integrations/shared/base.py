"""What every model family is: the :class:`ModelFamily` protocol (the fingerprints of the
diffusers code a family relies on are in :mod:`~ditops.integrations.shared.fingerprints`).

A family's patch is made of the pieces beside this module: what was asked
(:mod:`~ditops.integrations.shared.options`), the record of every change, to undo it
(:mod:`~ditops.integrations.shared.undo`), the refusals
(:mod:`~ditops.integrations.shared.refusals`), the base of ditops' attention processors
(:mod:`~ditops.integrations.shared.processors`) and the guard
(:mod:`~ditops.integrations.shared.guard`).
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import nn

from ditops.integrations.shared.options import PatchOptions
from ditops.integrations.shared.undo import PatchRecord

# --- model families ---------------------------------------------------------------------------


def is_plain_layer_norm(m: object) -> bool:
    """An ``nn.LayerNorm`` itself (no subclass) without affine parameters."""
    return type(m) is nn.LayerNorm and not m.elementwise_affine  # type: ignore[union-attr]


class ModelFamily(Protocol):
    """One kind of model ditops knows how to patch (one module per family)."""

    #: Shown in reports and errors, e.g. ``"wan"``.
    name: str
    #: diffusers' class names of the models it patches (empty: any model); what the docs'
    #: families table lists.
    model_classes: tuple[str, ...]
    #: Whether ``patch(..., attention=BlockSparseConfig(...))`` is served (else refused).
    sparse_attention: bool
    #: What the patch does, in a few words (the docs' families table).
    summary: str

    def recognise(self, model: nn.Module) -> bool:
        """Whether ``model`` belongs to this family."""
        ...

    def check(self, model: nn.Module, options: PatchOptions) -> Any:
        """Everything the patch relies on, checked before any change; returns a plan.

        Raises :class:`PatchError` naming every problem; changes nothing.
        """
        ...

    def apply(
        self, model: nn.Module, plan: Any, record: PatchRecord, options: PatchOptions
    ) -> None:
        """Patch in place, recording every change on ``record``."""
        ...
