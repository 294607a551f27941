"""The op registry and the process-wide dispatch state (run-time failures, warnings given)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ditops import config
from ditops.backends.base import all_backends
from ditops.core.declared import Declared

logger = logging.getLogger("ditops")


class _State:
    """What the dispatcher learned in this process; ``version`` is bumped when
    ``broken`` changes, so cached plans are recomputed."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        # (op name, device kind, path) -> why that path was given up at run time.
        self.broken: dict[tuple[str, str, str], str] = {}
        self.warned: set[tuple[str, str]] = set()  # (op name, backend name) warned about
        self.version = 0


STATE = _State()
_registry: dict[str, type[Declared]] = {}


def add(name: str, cls: type[Declared]) -> None:
    """Record ``cls`` under ``name`` (see :func:`ditops.core.op.register_op`)."""
    existing = _registry.get(name)
    if existing is not None and existing is not cls:
        raise ValueError(
            f"an op named {name!r} is already registered ({existing.__module__}."
            f"{existing.__qualname__}); op names must be unique"
        )
    _registry[name] = cls


def registered_ops() -> dict[str, type[Declared]]:
    """All registered op classes by name."""
    return dict(_registry)


def reset_state() -> None:
    """Forget backend probes, run-time failures, warnings given, cached plans and tuned
    choices held in memory.

    For tests that install or remove (fake) packages within one process.
    """
    with STATE.lock:
        STATE.broken.clear()
        STATE.warned.clear()
        STATE.version += 1
    for backend in all_backends():
        backend.reset()
    for forget in _on_reset:
        forget()


#: Called by :func:`reset_state` (the cached plans and the tuner's in-memory choices
#: register here).
_on_reset: list[Callable[[], None]] = []


def on_reset(fn: Callable[[], None]) -> None:
    """Have :func:`reset_state` call ``fn`` too."""
    _on_reset.append(fn)


def warn_once(op_name: str, backend: str, message: str) -> None:
    """One warning per (op, backend) per process: the op falls back to its meaning."""
    key = (op_name, backend)
    with STATE.lock:
        if key in STATE.warned:
            return
        STATE.warned.add(key)
    logger.warning("ditops op %r falls back to forward_native: %s", op_name, message)


config.know_op_names(lambda: _registry)  # the settings check op names against these
