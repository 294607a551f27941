"""How a patch says no: :class:`PatchError`, raised before anything changes, naming every
problem found (:func:`refuse`), and the refusal of sparse attention by a family without it."""

from __future__ import annotations

from torch import nn


class PatchError(ValueError):
    """The model cannot be patched as asked; nothing was changed."""


def refuse(model: nn.Module, problems: list[str]) -> None:
    """Raise the PatchError listing ``problems`` (at most 8), if there are any."""
    if problems:
        listed = "\n  - ".join(problems[:8]) + ("\n  - ..." if len(problems) > 8 else "")
        raise PatchError(
            f"ditops.patch refuses this {type(model).__name__}; nothing was changed:\n  - {listed}"
        )


#: The model classes of the families that serve sparse attention (``patching`` fills it
#: from its families), for the refusal the others give.
SPARSE_MODELS: list[str] = []


def refuse_sparse(model: nn.Module, what: str) -> None:
    """Raise the PatchError of a family without sparse attention asked for it."""
    raise PatchError(
        f"sparse attention is supported for {', '.join(SPARSE_MODELS)}, not for "
        f"{type(model).__name__}; call patch(..., attention=None) to patch its {what} only"
    )
