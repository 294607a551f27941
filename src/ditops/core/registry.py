"""The op registry and the process-wide dispatch state (run-time failures, warnings given)."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from ditops.backends.base import all_backends

if TYPE_CHECKING:
    from ditops.core.op import CustomOp


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
_registry: dict[str, type[CustomOp]] = {}


def add(name: str, cls: type[CustomOp]) -> None:
    """Record ``cls`` under ``name`` (see :func:`ditops.core.op.register_op`)."""
    existing = _registry.get(name)
    if existing is not None and existing is not cls:
        raise ValueError(
            f"an op named {name!r} is already registered ({existing.__module__}."
            f"{existing.__qualname__}); op names must be unique"
        )
    _registry[name] = cls


def registered_ops() -> dict[str, type[CustomOp]]:
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
    for cls in _registry.values():
        cls._plans = {}
    from ditops.core import tune  # here: tune imports config, which imports this module

    tune.forget()


def finite(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """0-d bool: no NaN/inf in ``tensors``. One ``aminmax`` per tensor: a single read, no
    temporary, no overflow (a sum in fp16 could overflow)."""
    flags = [torch.isfinite(torch.stack(torch.aminmax(t))).all() for t in tensors if t.numel()]
    return torch.stack(flags).all() if flags else torch.tensor(True)
