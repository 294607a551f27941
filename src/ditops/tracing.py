"""What the dispatcher needs from torch.compile, without importing ``torch._dynamo``.

``import ditops`` must stay light (no torch._dynamo, which imports Triton when it is
installed). :func:`trace_time_constant` marks a function the way
``torch.compiler.assume_constant_result`` does (that function imports ``torch._dynamo``
to set one attribute): dynamo then runs it as plain Python while tracing and puts its
result into the graph as a constant. ``tests/test_tracing.py`` checks that the marker is
still the one torch sets, so a torch upgrade that changes it fails loudly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

#: The attribute ``torch._dynamo.assume_constant_result`` sets on a function.
MARKER = "_dynamo_marked_constant"


def trace_time_constant(fn: F) -> F:
    """Mark ``fn`` as returning a constant for torch.compile (ints, strings, bools...).

    Arguments reaching it from a traced frame are guarded by value (constants) or by
    identity (objects), so a graph recompiles when they change.
    """
    setattr(fn, MARKER, True)
    return fn
