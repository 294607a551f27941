"""Running a chosen path, and what happens when it raises.

When a path raises, the meaning runs on the same call: if it raises too the caller's
inputs are at fault and its error is raised unchanged, with no state changed; if not, the
path is given up for that op and device kind (one warning per op and backend), or, in
strict mode (``DITOPS_STRICT=1``), :class:`~ditops.core.plan.BackendUnavailableError` is
raised. On an accelerator a path that does not propagate NaN/inf as the meaning does is
followed by the op's ``mend_non_finite`` (on the device: nothing is read back).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ditops import config
from ditops.core import registry
from ditops.core.calls import OpCall, invoke
from ditops.core.declared import Declared
from ditops.core.paths import NATIVE, PathSpec
from ditops.core.plan import BackendUnavailableError, guards
from ditops.core.registry import STATE


def run_meaning(op: Declared, call: OpCall) -> Any:
    """The op's meaning on the call."""
    return invoke(type(op).meaning, op, call)


def run_path(
    op: Declared, kind: str, spec: PathSpec, fn: Callable[[Any, OpCall], Any], call: OpCall
) -> Any:
    """Run one usable path on a call: the meaning if it raises (:func:`after_failure`),
    the non-finite mend on accelerators."""
    try:
        out = fn(op, call)
    except Exception as exc:  # noqa: BLE001 - classified: caller's error or backend's
        return after_failure(op, kind, spec, exc, call)
    return mended(op, spec, kind, call, out)


def mended(op: Declared, spec: PathSpec, kind: str, call: OpCall, out: Any) -> Any:
    """``out``, with NaN where the meaning has it, on an accelerator for a guarded path."""
    if kind != "cpu" and guards(op, spec):
        return op.mend_non_finite(call, out)
    return out


def after_failure(op: Declared, kind: str, spec: PathSpec, exc: Exception, call: OpCall) -> Any:
    """A path raised: the meaning runs on the same call. If it raises too, the inputs
    are at fault: its error is raised as it is and nothing changes. If not, the path
    is given up for this device kind (one warning; strict mode raises)."""
    try:
        result = run_meaning(op, call)
    except Exception as native_exc:  # noqa: BLE001 - re-raised as it is
        raise native_exc.with_traceback(native_exc.__traceback__) from None
    give_up(op, kind, spec, exc)
    return result


def give_up(op: Declared, kind: str, spec: PathSpec, exc: Exception) -> None:
    """Record ``spec`` as broken for (op, kind) and warn once; strict mode raises."""
    name = op.op_name
    backend = spec.backend.name if spec.backend is not None else kind
    hint = spec.backend.install_hint if spec.backend is not None else ""
    why = f"{spec.name} raised {type(exc).__name__}: {exc}"
    if config.get().strict:
        raise BackendUnavailableError(
            f"ditops op {name!r}: {why} (strict mode: not falling back). "
            f"Unset DITOPS_STRICT to fall back to forward_native. {hint}"
        ) from exc
    with STATE.lock:
        STATE.broken[(name, kind, spec.name)] = why
        STATE.version += 1
    rest = [s.name for s in type(op).paths_by_kind.get(kind, ()) if s is not spec]
    after = f"the next usable of {', '.join(rest)}, else forward_native" if rest else NATIVE
    registry.warn_once(
        name, backend, f"{why}; this call ran forward_native, later {kind} calls run {after}"
    )
