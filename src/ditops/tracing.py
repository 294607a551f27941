"""What the dispatcher needs from torch.compile, without importing ``torch._dynamo``.

``import ditops`` must stay light (no torch._dynamo, which imports Triton when it is
installed). :func:`trace_time_constant` marks a function the way
``torch.compiler.assume_constant_result`` does (that function imports ``torch._dynamo``
to set one attribute): dynamo then runs it as plain Python while tracing and puts its
result into the graph as a constant. ``tests/test_tracing.py`` checks that the marker is
still the one torch sets, so a torch upgrade that changes it fails loudly.

:func:`traced` is ditops' one question "is this code being traced into a graph?".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

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


def traced() -> bool:
    """True when the calling code is being traced into a graph: by torch.compile's
    dynamo (``torch.compiler.is_dynamo_compiling()``, which dynamo answers True in the
    frames it traces and which is False everywhere else) or by export's non-strict
    tracing.

    Not ``torch.compiler.is_compiling()``: that is one flag for the whole process, True
    while *any* thread compiles, so an eager call in another thread would take the
    traced branches (trace-time dispatch, no non-finite check, eager FlexAttention).
    ``tests/test_tracing_threads.py`` holds the cases.
    """
    if torch.compiler.is_dynamo_compiling():
        return True
    return _non_strict_tracing is not None and bool(_non_strict_tracing())


# Private in torch 2.13 (absent before): looked up once, not on every op call. Like
# is_compiling(), torch keeps it as one process-wide flag, so a non-strict export in one
# thread still reads as traced in the others; dynamo's answer above is per frame.
_non_strict_tracing = getattr(torch.compiler, "_is_non_strict_tracing", None)
