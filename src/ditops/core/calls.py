"""Call records: one validated, normalised call of an op.

An op's ``prepare(...)`` checks its arguments once and returns a record (a dataclass
subclassing :class:`OpCall`); the dispatcher hands that record to the reasons and to the
chosen path, so nothing is validated twice and no path re-reads raw arguments. Ops
without a record type get :class:`Args` (the arguments as given).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch


class OpCall:
    """Base of call records. ``exact``: the precision in force, set by the dispatcher
    before a path runs (a path honouring both precisions reads it)."""

    __slots__ = ("exact",)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the call (for the dtype, grad and device checks): fields that
        are tensors, tuples/lists/dicts of tensors, or objects with a ``tensors()``.
        A list built by loops, not nested generators: it runs on every call."""
        found: list[torch.Tensor] = []
        for name in _field_names(type(self)):
            value = getattr(self, name)
            if isinstance(value, torch.Tensor):
                found.append(value)
            elif not isinstance(value, _PLAIN):
                _collect(value, found)
        return found

    def first_tensor(self) -> torch.Tensor | None:
        """The tensor whose device decides the path: the first tensor field (a fast
        look at the fields themselves before searching inside them)."""
        for name in _field_names(type(self)):
            value = getattr(self, name)
            if isinstance(value, torch.Tensor):
                return value
        found = self.tensors()
        return found[0] if found else None

    def with_tensors(self, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> OpCall:
        """A copy with the named tensor fields replaced (torch.cond's branches rebuild
        the call from their operands)."""
        new = dataclasses.replace(self, **dict(zip(names, tensors)))  # type: ignore[type-var]
        new.exact = getattr(self, "exact", False)
        return new

    def tensor_fields(self) -> list[str]:
        """The names of the fields holding a tensor."""
        return [n for n in _field_names(type(self)) if isinstance(getattr(self, n), torch.Tensor)]


class Args(OpCall):
    """The call of an op that declares no record: its arguments as given."""

    __slots__ = ("args", "kwargs")

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.args = args
        self.kwargs = kwargs
        self.exact = False

    def tensors(self) -> list[torch.Tensor]:
        return [a for a in (*self.args, *self.kwargs.values()) if isinstance(a, torch.Tensor)]

    def first_tensor(self) -> torch.Tensor | None:
        found = self.tensors()
        return found[0] if found else None

    def tensor_fields(self) -> list[str]:
        return [str(i) for i, a in enumerate(self.args) if isinstance(a, torch.Tensor)]

    def with_tensors(self, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> Args:
        args = list(self.args)
        for name, t in zip(names, tensors):
            args[int(name)] = t
        new = Args(tuple(args), self.kwargs)
        new.exact = self.exact
        return new

    def get(self, name: int | str) -> Any:
        return self.args[int(name)] if int(name) < len(self.args) else None


def invoke(fn: Callable[..., Any], op: Any, call: OpCall) -> Any:
    """Call an op's function (its meaning or a path) on a call: the record, or, for an op
    without a record type, the arguments as given."""
    if isinstance(call, Args):
        return fn(op, *call.args, **call.kwargs)
    return fn(op, call)


def _field_names(cls: type) -> Iterator[str]:
    # The dataclass's own table, read as it is: torch.compile traces a class attribute's
    # dict, not dataclasses.fields() of a class.
    return iter(cls.__dataclass_fields__)  # type: ignore[attr-defined]


_PLAIN = (int, float, str, bool, type(None), torch.dtype)


def _collect(value: Any, found: list[torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, _PLAIN):  # most fields: nothing to look into
        return
    elif isinstance(value, (tuple, list)):
        for v in value:
            if isinstance(v, torch.Tensor):
                found.append(v)
    elif isinstance(value, dict):
        for v in value.values():
            _collect(v, found)
    elif hasattr(value, "tensors"):
        found.extend(value.tensors())
