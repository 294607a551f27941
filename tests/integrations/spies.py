"""Counting the calls that reach ops' CPU fast paths, so a parity test can show that the
fused path ran (a silent fall back to the eager expressions would be trivially equal)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import pytest

import ditops


def spy_forward_cpu(monkeypatch: pytest.MonkeyPatch, classes: Iterable[type]) -> Iterator[dict]:
    """Yields ``{op_name: calls}`` of each class's ``forward_cpu``; plans are dropped before
    and after so the dispatcher sees the spies."""
    calls: dict[str, int] = {}
    for cls in classes:
        original = cls.forward_cpu

        def spy(self, *a, _original=original, _name=cls.op_name, **k):
            calls[_name] = calls.get(_name, 0) + 1
            return _original(self, *a, **k)

        spy._ditops_path = original._ditops_path  # type: ignore[attr-defined]
        monkeypatch.setattr(cls, "forward_cpu", spy)
        cls._plans = {}
    yield calls
    for cls in ditops.registered_ops().values():
        cls._plans = {}
