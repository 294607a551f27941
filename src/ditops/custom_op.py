"""The public face of the op machinery (it lives in :mod:`ditops.core`).

An op subclasses :class:`CustomOp`, registers with :func:`register_op`, declares its
call with ``prepare`` and its paths with :func:`path`; :func:`explain` says what runs
where. ``fast_path`` is :func:`path`'s former name.
"""

from __future__ import annotations

from ditops.core.calls import Args, OpCall
from ditops.core.explain import explain
from ditops.core.op import CustomOp, register_op
from ditops.core.paths import NATIVE, Decision, PathReport, PathSpec, path
from ditops.core.plan import NON_FINITE_REASON, BackendUnavailableError
from ditops.core.registry import registered_ops, reset_state

fast_path = path

__all__ = [
    "NATIVE",
    "NON_FINITE_REASON",
    "Args",
    "BackendUnavailableError",
    "CustomOp",
    "Decision",
    "OpCall",
    "PathReport",
    "PathSpec",
    "explain",
    "fast_path",
    "path",
    "register_op",
    "registered_ops",
    "reset_state",
]
