"""Timing never changes a result (ditops.core.tune): the tuner chooses only among paths
that give the call's static choice's bits, so the first call (timed), later calls
(the winner) and a run with another cache file or load all return the same bits.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from ditops import config
from ditops.core import plan as plans
from ditops.core import tune
from ditops.core.op import CustomOp, register_op
from ditops.core.paths import NATIVE, path
from ditops.core.registry import registered_ops, reset_state
from tests.tune_helpers import tuning_on

SLEEP = {"forward_cpu": 0.0, "forward_cpu_b": 0.0, "native": 0.0}


@register_op("toy_bits")
class ToyBits(CustomOp):
    """Meaning 2 * x; forward_cpu gives other bits in fast (a different rounding),
    forward_cpu_b the meaning's in both precisions."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(SLEEP["native"])
        return x * 2

    @path(precisions=("exact", "fast"))
    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(SLEEP["forward_cpu"])
        return x * 2 if self.resolved_precision() == "exact" else x * 2 + 1e-3

    @path("cpu", precisions=("exact", "fast"), fast_bits="native")
    def forward_cpu_b(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(SLEEP["forward_cpu_b"])
        return x * 2


@pytest.fixture(autouse=True)
def _tuning_on(tmp_path: Path) -> Iterator[Path]:
    SLEEP.update(forward_cpu=0.0, forward_cpu_b=0.0, native=0.0)
    with tuning_on(tmp_path) as where:
        yield where


def test_fast_first_and_later_calls_give_the_same_bits_when_another_path_is_faster() -> None:
    SLEEP.update(forward_cpu=0.02)  # the static choice is the slowest: it would lose
    op, x = ToyBits(), torch.randn(4, 8)
    first = op(x)
    later = [op(x) for _ in range(3)]
    for out in later:
        assert torch.equal(out, first)


def test_fast_competitors_are_only_the_paths_with_the_static_choices_bits() -> None:
    fast = plans.plan(ToyBits, "cpu", "fast")
    assert fast.competitors == ()  # forward_cpu's fast bits are its own
    assert plans.plan(ToyBits, "cpu", "exact").competitors == (
        "forward_cpu",
        "forward_cpu_b",
        NATIVE,
    )


def test_a_recorded_winner_with_other_bits_is_not_used_even_in_cache_mode() -> None:
    op, x = ToyBits(), torch.randn(4, 8)
    with config.override(tune="off"):
        static = op(x)
    key = tune.class_key("toy_bits", "cpu", "fast", [x])
    tune._table.choices[key] = tune.Choice("forward_cpu_b", ("forward_cpu_b", NATIVE), {}, 0.0)
    for mode in ("on", "cache"):
        with config.override(tune=mode):
            assert torch.equal(op(x), static)
        assert op.explain_call(x).chosen == "forward_cpu"


def test_deterministic_algorithms_take_the_static_order() -> None:
    op, x = ToyBits(), torch.randn(4, 8)
    key = tune.class_key("toy_bits", "cpu", "exact", [x])
    op.precision = "exact"
    tune._table.choices[key] = tune.Choice(
        "forward_cpu_b", ("forward_cpu", "forward_cpu_b", NATIVE), {}, 0.0
    )
    assert op.explain_call(x).chosen == "forward_cpu_b"
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert op.explain_call(x).chosen == "forward_cpu"
        calls: list[str] = []
        original = ToyBits.__dict__["forward_cpu_b"]
        try:
            ToyBits.forward_cpu_b = lambda self, c: calls.append("b") or original(self, c)  # type: ignore[method-assign]
            reset_state()
            tune._table.choices[key] = tune.Choice(
                "forward_cpu_b", ("forward_cpu", "forward_cpu_b", NATIVE), {}, 0.0
            )
            op(x)
        finally:
            ToyBits.forward_cpu_b = original  # type: ignore[method-assign]
            reset_state()
        assert calls == []
    finally:
        torch.use_deterministic_algorithms(was)


# --- every registered op: whatever wins, the bits are the static choice's ---------------


def _rows(*shape: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _estimate() -> tuple[Callable[..., object], tuple[object, ...], dict[str, object]]:
    q, k = _rows(1, 2, 256, 32, seed=1), _rows(1, 2, 256, 32, seed=2)
    return registered_ops()["estimate_block_mask"](), (q, k), {"block_size": 64, "keep_ratio": 0.5}


def _attention() -> tuple[Callable[..., object], tuple[object, ...], dict[str, object]]:
    q, k, v = (_rows(1, 2, 256, 32, seed=s) for s in (1, 2, 3))
    mask, counts = registered_ops()["estimate_block_mask"]()(q, k, block_size=64, keep_ratio=0.5)
    return registered_ops()["block_sparse_attention"](), (q, k, v, mask, counts), {"block_size": 64}


def _sample(name: str) -> tuple[Callable[..., object], tuple[object, ...], dict[str, object]]:
    x, r = _rows(2, 16, 64, seed=4), _rows(2, 16, 64, seed=5)
    mod = _rows(2, 1, 64, seed=6)
    w, b = _rows(64, dtype=torch.float32, seed=7), _rows(64, dtype=torch.float32, seed=8)
    f32 = torch.float32
    cos, sin = _rows(16, 32, dtype=f32, seed=9), _rows(16, 32, dtype=f32, seed=10)
    q4, k4 = _rows(1, 16, 2, 32, seed=11), _rows(1, 16, 2, 32, seed=12)
    samples: dict[str, tuple[tuple[object, ...], dict[str, object]]] = {
        "fp32_layer_norm": ((x, (64,), w, b), {}),
        "layer_norm_scale_shift": ((x,), {"scale": mod, "shift": mod}),
        "gated_residual": ((r, x, mod), {}),
        "scale_residual_layer_norm_scale_shift": ((r, x, mod), {"scale": mod, "shift": mod}),
        "rms_norm": ((q4, w[:32].to(torch.bfloat16)), {"eps": 1e-6}),
        "rms_norm_scale": ((x, mod, 1e-6), {"weight": w.to(x.dtype), "shift": mod}),
        "rotary_embedding": ((q4, cos, sin), {}),
        "qk_norm_rope": ((q4, k4, None, None, cos, sin, 1e-6), {}),
        "gelu_tanh_bias": ((x,), {}),
        "adaln_modulate": ((x, mod, mod), {}),
        "adaln_residual": ((r, x, mod), {}),
        "adaln_residual_modulate": ((r, x, mod, mod, mod), {}),
    }
    if name == "estimate_block_mask":
        return _estimate()
    if name == "block_sparse_attention":
        return _attention()
    args, kwargs = samples[name]
    return registered_ops()[name](), args, kwargs


def _bits(out: object) -> list[torch.Tensor]:
    return [t.view(torch.uint8) if t.dtype != torch.bool else t for t in (
        out if isinstance(out, tuple) else (out,))]  # fmt: skip


@pytest.mark.parametrize("precision", ["fast", "exact"])
@pytest.mark.parametrize(
    "name", [n for n in registered_ops() if not n.startswith("toy") and n != "gelu_tanh_bias"]
)
def test_whichever_path_a_cache_names_the_result_is_the_static_choices(
    name: str, precision: str
) -> None:
    """A cache file may name any path (another machine's load, an older ditops): the
    call's bits stay what DITOPS_TUNE=off gives."""
    op, args, kwargs = _sample(name)
    op.precision = precision  # type: ignore[attr-defined]
    with torch.no_grad():
        with config.override(tune="off"):
            static = _bits(op(*args, **kwargs))
        call = op.prepare(*args, **kwargs)  # type: ignore[attr-defined]
        key = tune.class_key(name, "cpu", precision, call.tensors())
        declared = [s.name for s in type(op).paths_by_kind.get("cpu", ())] + [NATIVE]
        for winner in declared:
            reset_state()
            tune._table.choices[key] = tune.Choice(winner, tuple(declared), {}, 0.0)
            with config.override(tune="cache"):
                got = _bits(op(*args, **kwargs))
            assert all(torch.equal(a, b) for a, b in zip(got, static, strict=True)), winner


@pytest.mark.parametrize("name", [n for n in registered_ops() if not n.startswith("toy")])
def test_a_path_declaring_the_meanings_fast_bits_gives_them(name: str) -> None:
    """``fast_bits="native"`` is a promise the tuner relies on: checked on the sample."""
    from ditops.core.same_bits import bits_of

    op, args, kwargs = _sample(name) if name != "gelu_tanh_bias" else (
        registered_ops()[name](), (_rows(2, 16, 64),), {})  # fmt: skip
    op.precision = "fast"  # type: ignore[attr-defined]
    with torch.no_grad():
        want = _bits(op.forward_native(*args, **kwargs))  # type: ignore[attr-defined]
        for spec in type(op).paths_by_kind.get("cpu", ()):
            if bits_of(spec, "fast") == NATIVE:
                got = _bits(getattr(op, spec.name)(*args, **kwargs))
                assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), spec.name
