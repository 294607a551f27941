"""Dispatch inside ``torch.compile``: the choice is made at trace time and becomes part of
the graph (see :meth:`ditops.core.op.CustomOp.run`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ditops import config
from ditops.core.calls import Args, OpCall, invoke
from ditops.core.paths import PathSpec, runner
from ditops.core.registry import finite
from ditops.tracing import trace_time_constant

if TYPE_CHECKING:
    from ditops.core.op import CustomOp


def run_traced(op: CustomOp, kind: str, call: OpCall, module_precision: str | None) -> Any:
    """Dispatch inside ``torch.compile``: the static choice is made in plain Python at
    trace time (:func:`traced_paths`: no lock, probe or warning is traced) and the
    graph is guarded on the values it read (precision, the thread's settings). A
    path's failure here is a compile error, not a fallback."""
    config.ensure_loaded()
    cfg = config.get()
    precision = module_precision or cfg.precision
    names = traced_paths(type(op), kind, precision, cfg.custom_ops.text, cfg.strict)
    for name in filter(None, names.split(",")):
        spec = type(op)._specs[name]
        if op._call_reasons(spec, kind, call):
            continue
        call.exact = precision == "exact"
        if kind != "cpu" or not op._guards(spec, kind):
            return op._mended(
                spec, kind, call, runner(type(op), spec, isinstance(call, Args))(op, call)
            )
        return cond_on_finite(op, spec, call)
    return invoke(type(op)._native, op, call)  # type: ignore[arg-type]


def cond_on_finite(op: CustomOp, spec: PathSpec, call: OpCall) -> Any:
    """No data-dependent branch in a graph: torch.cond picks the meaning when a guarded
    input holds NaN/inf. Its branches return outputs flat (it cannot prove symbolic
    strides dense), shaped back after."""
    names = call.tensor_fields()
    shape = op.output_shape(call)

    def flat(fn: Callable[..., Any]) -> Callable[..., torch.Tensor]:
        def branch(*ts: torch.Tensor) -> torch.Tensor:
            return invoke(fn, op, call.with_tensors(names, ts)).contiguous().reshape(-1)

        return branch

    get = call.get if isinstance(call, Args) else lambda n: getattr(call, n)
    operands = tuple(get(n) for n in names)
    native = type(op)._native
    out = torch.cond(finite(op._guarded(call)), flat(spec.fn), flat(native), operands)  # type: ignore[arg-type]
    return out.view(shape)


@trace_time_constant
def traced_paths(
    cls: type[CustomOp], kind: str, precision: str, custom_ops: str, strict: bool
) -> str:
    """The usable paths of ``cls`` for ``kind`` (names, comma-separated), for a graph being
    traced: plain Python at trace time. ``custom_ops`` and ``strict`` are not read here
    (the plan reads the thread's settings): passing them guards the graph on them."""
    return ",".join(spec.name for spec, _ in cls._plan(kind, precision).paths)
