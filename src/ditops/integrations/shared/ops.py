"""The op bundle of one patched model: the one way precision travels into a patch."""

from __future__ import annotations


class Ops:
    """The ops of one patched model, each made with the precision asked.

    ``Ops(precision, qk=QKNormRopeOp, ...)`` makes ``ops.qk``: one instance per op, its
    ``precision`` set here once; fused forwards and processors take their ops from the
    bundle. A plain object: it deep-copies and pickles with the model.
    """

    def __init__(self, precision: str | None, **ops: type) -> None:
        self.precision = precision
        for name, cls in ops.items():
            op = cls()
            op.precision = precision
            setattr(self, name, op)
