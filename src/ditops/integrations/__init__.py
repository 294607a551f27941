"""Patching other people's models in place: diffusers first."""

from ditops.integrations.patching import (
    PatchError,
    PatchReport,
    explain_patch,
    patch,
    sparse_densities,
    unpatch,
)
from ditops.integrations.shared.steps import set_step

__all__ = [
    "PatchError",
    "PatchReport",
    "explain_patch",
    "patch",
    "set_step",
    "sparse_densities",
    "unpatch",
]
