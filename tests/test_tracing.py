"""The trace-time constant marker is the one torch.compile reads."""

from __future__ import annotations

import pytest
import torch

from ditops.tracing import MARKER, trace_time_constant


def test_marker_matches_torch() -> None:
    def f() -> int:
        return 1

    torch.compiler.assume_constant_result(f)
    assert getattr(f, MARKER, False) is True


def test_marked_function_runs_at_trace_time_and_is_guarded() -> None:
    calls: list[str] = []

    @trace_time_constant
    def choose(mode: str) -> str:
        calls.append(mode)
        return "plus" if mode == "a" else "minus"

    state = {"mode": "a"}

    @torch.compile(fullgraph=True, backend="eager")
    def f(x: torch.Tensor) -> torch.Tensor:
        return x + 1 if choose(state["mode"]) == "plus" else x - 1

    x = torch.zeros(2)
    assert torch.equal(f(x), x + 1) and torch.equal(f(x), x + 1)
    state["mode"] = "b"
    assert torch.equal(f(x), x - 1)
    assert calls == ["a", "b"]  # once per trace, not per call


def test_refuse_under_fullgraph_raises_only_when_the_trace_may_not_break() -> None:
    """The private dynamo state it reads is still there: a fullgraph trace gets ditops'
    message (as the cause dynamo reports), one that may break the graph runs on."""
    from ditops.tracing import refuse_under_fullgraph, traced

    def f(x: torch.Tensor) -> torch.Tensor:
        if traced():
            refuse_under_fullgraph("ditops: what to change")
        return x + 1

    x = torch.zeros(2)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(f, backend="eager")(x), x + 1)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="ditops: what to change") as err:
        torch.compile(f, fullgraph=True, backend="eager")(x)
    assert "ValueError" in str(err.value) or isinstance(err.value, ValueError)
    torch._dynamo.reset()
    with torch._dynamo.error_on_graph_break(True), pytest.raises(Exception, match="ditops"):
        torch.compile(f, backend="eager")(x)
    assert torch.equal(f(x), x + 1)  # eager: never asked
