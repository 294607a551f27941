"""The trace-time constant marker is the one torch.compile reads."""

from __future__ import annotations

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
