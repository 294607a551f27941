"""Patching other people's models in place: diffusers first."""

from ditops.integrations.patching import PatchError, PatchReport, patch, unpatch
from ditops.integrations.steps import set_step

__all__ = ["PatchError", "PatchReport", "patch", "set_step", "unpatch"]
