"""Call records: one validated, normalised call of an op.

An op's ``prepare(...)`` checks its arguments once and returns a record (a dataclass
subclassing :class:`OpCall`); the dispatcher hands that record to the reasons and to the
chosen path, so nothing is validated twice and no path re-reads raw arguments. Ops
without a record type get :class:`Args` (the arguments as given).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ditops.tracing import trace_time_constant


class OpCall:
    """Base of call records. ``exact``: the precision in force, set by the dispatcher
    before a path runs (a path honouring both precisions reads it)."""

    __slots__ = ("exact",)

    def tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor of the call (for the dtype, grad and device checks): fields that
        are tensors, tuples/lists/dicts of tensors, or objects with a ``tensors()``."""
        for name in _field_names(type(self)):
            yield from _tensors_in(getattr(self, name))

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

    def tensors(self) -> Iterator[torch.Tensor]:
        for a in (*self.args, *self.kwargs.values()):
            if isinstance(a, torch.Tensor):
                yield a

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


_FIELDS: dict[type, tuple[str, ...]] = {}


@trace_time_constant  # dynamo cannot trace dataclasses.fields on a class: run at trace time
def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]
    return names


def _tensors_in(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            if isinstance(v, torch.Tensor):
                yield v
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors_in(v)
    elif hasattr(value, "tensors"):
        yield from value.tensors()
