"""The op bundle of one patched model: the one way precision travels into a patch.

Each kind of bundle is a dataclass that declares its ops as typed fields
(``qk: QKNormRopeOp``), so ``ops.qk`` in a fused forward is an attribute a reader and a
type checker can follow to the op it runs. ``Bundle.of(precision)`` makes one: an
instance of each field's op class, its ``precision`` set once here. Plain objects: they
deep-copy and pickle with the model.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Self

from ditops.ops.qk_norm_rope import QKNormRopeOp


@dataclasses.dataclass(eq=False)
class Ops:
    """Base of the bundles: the precision every op of it was made with."""

    precision: str | None

    @classmethod
    def of(cls, precision: str | None) -> Self:
        """The bundle with one op per field, each with ``precision``."""
        types = typing.get_type_hints(cls)
        ops = {}
        for f in dataclasses.fields(cls):
            if f.name != "precision":
                op = ops[f.name] = types[f.name]()
                op.precision = precision
        return cls(precision, **ops)


@dataclasses.dataclass(eq=False)
class QKOps(Ops):
    """A bundle whose attention processors fuse the q/k prologue (norm and rotary)."""

    qk: QKNormRopeOp
