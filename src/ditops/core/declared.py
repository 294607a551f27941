"""What the dispatcher reads of an op: its declaration.

:class:`ditops.core.op.CustomOp` is the one class that declares ops; this protocol names
the part of it the dispatcher's modules (:mod:`ditops.core.plan`,
:mod:`ditops.core.fallback`, :mod:`ditops.core.tune`, :mod:`ditops.core.traced`,
:mod:`ditops.core.dispatch`) read, so they sit below the class that calls them and import
nothing above.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Protocol

import torch

from ditops.core.paths import PathSpec


class Declared(Protocol):
    """An op as declared (see :class:`ditops.core.op.CustomOp` for each name's meaning)."""

    op_name: ClassVar[str]
    non_finite_inputs: ClassVar[tuple[int | str, ...]]
    meaning_competes: ClassVar[bool]
    small_calls_run_meaning: ClassVar[bool]
    #: Its paths by method name, in declaration order, and per device kind.
    declared_paths: ClassVar[dict[str, PathSpec]]
    paths_by_kind: ClassVar[dict[str, tuple[PathSpec, ...]]]
    #: The meaning as written (``forward_native(self, call)`` or ``(self, *args)``).
    meaning: ClassVar[Callable[..., Any]]
    #: Whether ``prepare`` is the base's: the call is the arguments as given.
    takes_arguments: ClassVar[bool]
    #: Whether ``answer_without_paths`` / ``not_supported`` are defined (else not called).
    answers_early: ClassVar[bool]
    refuses: ClassVar[bool]

    @property
    def precision(self) -> str | None: ...

    def not_supported(self, call: Any) -> list[str]: ...

    def answer_without_paths(self, call: Any) -> Any: ...

    def mend_non_finite(self, call: Any, out: Any) -> Any: ...

    def output_shape(self, call: Any) -> tuple[int, ...]: ...

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]: ...
