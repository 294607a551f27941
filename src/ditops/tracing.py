"""What the dispatcher needs from torch.compile, without importing ``torch._dynamo``.

``import ditops`` must stay light (no torch._dynamo, which imports Triton when it is
installed). :func:`trace_time_constant` marks a function the way
``torch.compiler.assume_constant_result`` does (that function imports ``torch._dynamo``
to set one attribute): dynamo then runs it as plain Python while tracing and puts its
result into the graph as a constant. ``tests/test_tracing.py`` checks that the marker is
still the one torch sets, so a torch upgrade that changes it fails loudly.

:func:`traced` is ditops' one question "is this code being traced into a graph?".
:func:`refuse_under_fullgraph` turns a graph break ditops is about to make into an error
that says what to change, when the trace may not break (``fullgraph=True``).
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


@trace_time_constant
def refuse_under_fullgraph(message: str) -> bool:
    """Raise ``ValueError(message)`` when dynamo traces this frame with ``fullgraph=True``
    (or under ``torch._dynamo.error_on_graph_break(True)``); else return False.

    Call it under :func:`traced`, where ditops' code will break the graph, as early as
    the trace allows (dynamo's own error there names neither ditops nor the option to
    change). It runs as plain Python at trace time (a trace-time constant), so it costs
    nothing in the graph. It reads dynamo's private translator state (torch 2.13:
    ``InstructionTranslator.current_tx().one_graph``); if torch renames it this returns
    False and dynamo's own error stands (``tests/test_tracing.py`` would fail first).
    """
    from torch._dynamo import symbolic_convert, utils  # traced() holds: dynamo is loaded

    try:
        tx = symbolic_convert.InstructionTranslator.current_tx()
        strict = bool(getattr(tx, "one_graph", False) or utils._get_error_on_graph_break())
    except AttributeError:  # not dynamo (export's non-strict tracing), or a renamed state
        strict = False
    if strict:
        raise ValueError(message)
    return False
