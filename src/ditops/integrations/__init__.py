"""Patching other people's models in place: diffusers first."""

from ditops.integrations.patching import PatchError, PatchReport, explain_patch, patch, unpatch
from ditops.integrations.shared.steps import set_step

__all__ = ["PatchError", "PatchReport", "explain_patch", "patch", "set_step", "unpatch"]
