"""Counting the calls that reach ops' fast paths, so a parity test can show that the
fused path ran (a silent fall back to the eager expressions would be trivially equal)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import pytest

import ditops
from ditops.core import plan


def install_spies(
    monkeypatch: pytest.MonkeyPatch, classes: Iterable[type], path: str = "forward_cpu"
) -> dict[str, int]:
    """Replace each class's ``path`` method by one that counts its calls; returns the
    live ``{op_name: calls}`` and drops the classes' plans so the dispatcher sees the spies."""
    calls: dict[str, int] = {}
    for cls in classes:
        original = getattr(cls, path)

        def spy(self, *a, _original=original, _name=cls.op_name, **k):
            calls[_name] = calls.get(_name, 0) + 1
            return _original(self, *a, **k)

        spy._ditops_path = original._ditops_path  # type: ignore[attr-defined]
        monkeypatch.setattr(cls, path, spy)
        plan.forget(cls)
    return calls


def spy_forward_cpu(monkeypatch: pytest.MonkeyPatch, classes: Iterable[type]) -> Iterator[dict]:
    """For a fixture: yields the calls of each class's ``forward_cpu``, drops every op's
    plans afterwards."""
    yield install_spies(monkeypatch, classes)
    plan.forget()


#: The ops each family's fused forwards run (their forward_cpu is what the parity tests spy on).
WAN_OPS = (
    "layer_norm_scale_shift",
    "gated_residual",
    "scale_residual_layer_norm_scale_shift",
    "fp32_layer_norm",
    "qk_norm_rope",
)
FLUX_OPS = ("adaln_modulate", "adaln_residual", "adaln_residual_modulate", "qk_norm_rope")
HUNYUAN_OPS = (*FLUX_OPS, "rms_norm")
#: A FLUX-like tiny model of 2 double-stream and 2 single-stream blocks, patched (FLUX,
#: Chroma, FLUX.2): what the patch reports and, per forward, each op's calls (2 double
#: blocks: 2 modulated norms, 2 residual + norm, 2 residuals, the text and the image
#: prologue each; 2 single blocks: 1 of each; the output norm).
FLUX_FUSED = {"fused blocks": 4, "fused attention prologues": 4, "fused output norm": 1}
FLUX_PER_FORWARD = {
    "adaln_modulate": 2 * 2 + 2 + 1,
    "adaln_residual_modulate": 2 * 2,
    "adaln_residual": 2 * 2 + 2,
    "qk_norm_rope": 2 * 2 + 2,
}
#: Its calls with one block of each kind (the Triton paths' model).
FLUX_ONE_OF_EACH = {
    "adaln_modulate": 2 + 1 + 1,
    "adaln_residual_modulate": 2,
    "adaln_residual": 2 + 1,
    "qk_norm_rope": 2 + 1,
}


def cpu_paths_of(*op_names: str) -> Any:
    """A ``cpu_paths`` fixture: ``{op_name: calls}`` of each named op's ``forward_cpu``."""

    @pytest.fixture
    def cpu_paths(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict]:
        ops = ditops.registered_ops()
        yield from spy_forward_cpu(monkeypatch, [ops[name] for name in op_names])

    return cpu_paths
