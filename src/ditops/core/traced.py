"""Dispatch inside ``torch.compile``: the choice is made at trace time and becomes part of
the graph (see :func:`ditops.core.dispatch.run`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ditops import config
from ditops.core.calls import Args, OpCall, invoke
from ditops.core.declared import Declared
from ditops.core.fallback import mended, run_meaning
from ditops.core.paths import PathSpec, runner
from ditops.core.plan import call_reasons, finite, guarded_inputs, guards, plan
from ditops.tracing import trace_time_constant


def run_traced(op: Declared, kind: str, call: OpCall, module_precision: str | None) -> Any:
    """Dispatch inside ``torch.compile``: the static choice is made in plain Python at
    trace time (:func:`traced_paths`: no lock, probe or warning is traced) and the
    graph is guarded on the values it read (precision, the thread's settings). A
    path's failure here is a compile error, not a fallback."""
    config.ensure_loaded()
    cfg = config.get()
    precision = module_precision or cfg.precision
    names = traced_paths(type(op), kind, precision, cfg.custom_ops.text, cfg.strict)
    for name in filter(None, names.split(",")):
        spec = type(op).declared_paths[name]
        if call_reasons(op, spec, kind, call):
            continue
        call.exact = precision == "exact"
        if kind != "cpu" or not guards(op, spec):
            out = runner(type(op), spec, isinstance(call, Args))(op, call)
            return mended(op, spec, kind, call, out)
        return cond_on_finite(op, spec, call)
    return run_meaning(op, call)


def cond_on_finite(op: Declared, spec: PathSpec, call: OpCall) -> Any:
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
    meaning = type(op).meaning
    out = torch.cond(finite(guarded_inputs(op, call)), flat(spec.fn), flat(meaning), operands)
    return out.view(shape)


@trace_time_constant
def traced_paths(
    cls: type[Declared], kind: str, precision: str, custom_ops: str, strict: bool
) -> str:
    """The usable paths of ``cls`` for ``kind`` (names, comma-separated), for a graph being
    traced: plain Python at trace time. ``custom_ops`` and ``strict`` are not read here
    (the plan reads the thread's settings): passing them guards the graph on them."""
    return ",".join(spec.name for spec, _ in plan(cls, kind, precision).paths)
