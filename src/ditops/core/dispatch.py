"""The dispatcher: one prepared call of an op, to the path that runs it.

For the device kind of the call's first tensor, the first path of the plan
(:mod:`ditops.core.plan`) that nothing rules out for this call runs, else the meaning;
a path that raises falls back to the meaning (:mod:`ditops.core.fallback`). Inside
``torch.compile`` the choice is made at trace time (:mod:`ditops.core.traced`); where
several paths could serve, ``DITOPS_TUNE`` picks by measurement (:mod:`ditops.core.tune`).
:func:`explain` says what :func:`run` would do, with the reasons.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ditops import launch
from ditops.core import tune, tune_launch
from ditops.core.calls import OpCall
from ditops.core.declared import Declared
from ditops.core.fallback import run_meaning, run_path
from ditops.core.paths import NATIVE, Decision, PathReport
from ditops.core.plan import call_reasons, plan, small_call, small_why
from ditops.core.traced import run_traced
from ditops.platform import device_kind
from ditops.tracing import traced


def run(op: Declared, call: OpCall, precision: str | None = None) -> Any:
    """Run the best usable path of ``op`` for this prepared call; ``precision`` overrides
    the module's (a norm module passes its own)."""
    if type(op).answers_early:
        early = op.answer_without_paths(call)
        if early is not None:
            return early
    first = call.first_tensor()  # its device decides, as explain() reads it
    kind = device_kind(first) if first is not None else "cpu"
    precision = precision or op.precision
    if traced():
        return run_traced(op, kind, call, precision)
    chosen = plan(type(op), kind, precision)
    if chosen.small_meaning and small_call(chosen, first):
        return run_meaning(op, call)
    tensors = call.tensors()  # once: every path's checks read them
    if chosen.competitors:  # DITOPS_TUNE: the class's measured winner, or time them now
        out = tune.dispatch(op, kind, chosen, call, tensors)
        if out is not tune.STATIC:
            return out
    for spec, fn in chosen.paths:
        if call_reasons(op, spec, kind, call, tensors):
            continue
        call.exact = chosen.exact
        return run_path(op, kind, spec, fn, call)
    return run_meaning(op, call)


def explain(op: Declared, call: OpCall, precision: str | None = None) -> Decision:
    """The choice :func:`run` would make for this prepared call, with reasons."""
    first = call.first_tensor()
    kind = device_kind(first) if first is not None else "cpu"
    chosen_plan = plan(type(op), kind, precision or op.precision)
    base = chosen_plan.decision
    candidates: list[PathReport] = []
    chosen = NATIVE
    for report in base.candidates:
        spec = type(op).declared_paths.get(report.path)
        reasons = list(report.reasons)
        if not reasons and spec is not None:
            reasons = call_reasons(op, spec, kind, call)
        candidates.append(PathReport(report.path, reasons, report.accepts))
        if not reasons and chosen == NATIVE:
            chosen = report.path
    if first is not None and small_call(chosen_plan, first):
        return Decision(base.op, kind, base.precision, NATIVE, candidates, small_why(first))
    tuned = tune.recorded(op, kind, chosen_plan, call) if chosen_plan.competitors else None
    if tuned is not None and (
        tuned.winner == NATIVE or any(c.path == tuned.winner and c.usable for c in candidates)
    ):
        return Decision(base.op, kind, base.precision, tuned.winner, candidates, tuned.why())
    return Decision(base.op, kind, base.precision, chosen, candidates)


def tuned_launch(
    kernel: str,
    device: torch.device,
    shape: tuple[int, ...],
    configs: list[dict[str, Any]],
    run: Callable[[dict[str, Any]], None],
) -> None:
    """A kernel's launch (:mod:`ditops.launch`) with the tuned config for its device's kind
    (:func:`ditops.core.tune_launch.launch_config`)."""
    tune_launch.launch_config(kernel, device_kind(device), shape, configs, run)


launch.tuner = tuned_launch  # kernels reach the tuner through ditops.launch
