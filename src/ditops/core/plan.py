"""Which paths may run a call: the plan per (op, device kind, precision) and the per-call
checks.

The static part (the settings, the backend probe, earlier failures) is decided once per
(op class, device kind, precision, settings) and cached (:func:`plan`); the per-call part
(dtypes, grad, the op's and the path's own reasons, NaN/inf on CPU) reads the call record
(:func:`call_reasons`). What rules a path out is kept as plain-language reasons, so
explanations and ``ditops info`` say why.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ditops import config
from ditops.core import registry, same_bits
from ditops.core.calls import Args, OpCall
from ditops.core.checks import dtype_name
from ditops.core.declared import Declared
from ditops.core.paths import NATIVE, Decision, PathReport, PathSpec, runner
from ditops.core.registry import STATE, registered_ops
from ditops.tracing import traced


class BackendUnavailableError(RuntimeError):
    """Strict mode: a fast path could not be used. The message says why and what to install."""


#: CPU calls whose first tensor has at most this many elements run the meaning
#: (:attr:`Plan.small_meaning`), a static rule by size like the LayerNorm kernel's short
#: rows: below it the blocked kernels save nothing (their fp32 temporaries fit in L2
#: either way) and a path's per-call work (the tuner's class lookup, scratch, the walk
#: over blocks) costs more than the plain torch expression
#: (``benchmarks/cpu/probes/small_shapes.py``). The meaning is within every precision's
#: contract (``fast`` gets the meaning's bits there); it decides the same whatever
#: ``DITOPS_TUNE`` says, so tuning never changes a result.
SMALL_CALL_ELEMENTS = 32768

#: The reason a CPU call with NaN/inf in a guarded input runs the meaning.
NON_FINITE_REASON = "an input holds NaN or inf: the meaning runs, so they propagate as in it"


@dataclass(frozen=True)
class Plan:
    """The usable paths of one (op, device kind, precision), in order, with how each runs."""

    paths: tuple[tuple[PathSpec, Callable[[Any, OpCall], Any]], ...]
    exact: bool
    decision: Decision
    #: What DITOPS_TUNE times against each other (paths, then the meaning), when it may.
    competitors: tuple[str, ...] = ()
    #: Small calls (:data:`SMALL_CALL_ELEMENTS`) run the meaning: on CPU, where a path
    #: could run and the meaning competes (not a memory-bound oracle's).
    small_meaning: bool = False


#: op class -> (kind, precision, settings, state version) -> its plan.
_plans: dict[type, dict[tuple[Any, ...], Plan]] = {}


def plan(cls: type[Declared], kind: str, module_precision: str | None) -> Plan:
    """The cached plan for ``kind`` under the module's precision (None: the process's)."""
    cfg = config.get()
    precision = module_precision or cfg.precision
    # Keyed by the settings' values, not their version: a block under
    # config.override(...) with the same values reuses the plans. The selection by its
    # text (it is parsed from it): a str hashes once, a dataclass on every call.
    key = (kind, precision, cfg.custom_ops.text, cfg.strict, cfg.tune, STATE.version)
    plans = _plans.get(cls)
    if plans is None:
        plans = _plans[cls] = {}
    found = plans.get(key)
    if found is None:
        found = plans[key] = make_plan(cls, kind, precision, cfg)
    return found


def plans_of(cls: type) -> dict[tuple[Any, ...], Plan]:
    """The plans cached for ``cls`` (a copy)."""
    return dict(_plans.get(cls, {}))


def forget(cls: type | None = None) -> None:
    """Drop the cached plans of ``cls`` (None: of every op), so they are made again (a
    test's spy replacing a path is then seen)."""
    if cls is None:
        _plans.clear()
    else:
        _plans.pop(cls, None)


def make_plan(
    cls: type[Declared], kind: str, precision: str, cfg: config.Config, quiet: bool = False
) -> Plan:
    """Decide from the settings, backend probes and past failures. ``quiet``: for
    explanations (no warning, no strict error)."""
    cfg.custom_ops.check_names(registered_ops())
    specs = cls.paths_by_kind.get(kind, ())
    if not specs:
        report = PathReport(f"forward_{kind}", [f"ditops has no {kind} fast path for this op"])
        return Plan((), False, Decision(cls.op_name, kind, precision, NATIVE, [report]))
    candidates: list[PathReport] = []
    usable: list[PathSpec] = []
    for spec in specs:
        reasons = static_reasons(cls, spec, kind, precision, cfg, quiet)
        candidates.append(PathReport(spec.name, reasons, spec.accepts(), spec.per_call))
        if not reasons:
            usable.append(spec)
    chosen = usable[0].name if usable else NATIVE
    decision = Decision(cls.op_name, kind, precision, chosen, candidates)
    routes = tuple((spec, runner(cls, spec, cls.takes_arguments)) for spec in usable)
    # Only paths giving the same bits compete: timing never changes a result.
    same = same_bits.competitors(usable, precision, cls.meaning_competes)
    competitors = same if cfg.tune != "off" else ()
    small = kind == "cpu" and bool(usable) and cls.meaning_competes and cls.small_calls_run_meaning
    return Plan(routes, precision == "exact", decision, competitors, small)


def small_call(chosen: Plan, first: torch.Tensor | None) -> bool:
    """Whether a call whose first tensor is ``first`` runs the meaning by its size
    (:attr:`Plan.small_meaning`)."""
    return chosen.small_meaning and first is not None and first.numel() <= SMALL_CALL_ELEMENTS


def small_why(first: torch.Tensor) -> str:
    """Why a small call runs the meaning, in words (explanations)."""
    return (
        f"a small call ({first.numel()} elements <= {SMALL_CALL_ELEMENTS}): the meaning "
        "runs: it costs less than a path's call there (a static rule by size)"
    )


def static_reasons(
    cls: type[Declared], spec: PathSpec, kind: str, precision: str, cfg: config.Config, quiet: bool
) -> list[str]:
    """Why ``spec`` can take no call of ``kind`` under these settings (the plan's part)."""
    reasons: list[str] = []
    if not cfg.custom_ops.is_enabled(cls.op_name):
        reasons.append(f"disabled by DITOPS_CUSTOM_OPS={cfg.custom_ops.text!r}")
    if precision not in spec.precisions:
        gives = "/".join(sorted(spec.precisions))
        reasons.append(f"does not promise precision={precision!r} (it gives {gives})")
    if not reasons and spec.backend is not None:
        backend_reasons = spec.backend.probe()
        if backend_reasons and not quiet:
            message = "; ".join(backend_reasons)
            if cfg.strict:
                raise BackendUnavailableError(
                    f"ditops op {cls.op_name!r}: {spec.name} cannot run: {message} "
                    "(strict mode: not falling back; unset DITOPS_STRICT to fall back)"
                )
            registry.warn_once(cls.op_name, spec.backend.name, message)
        reasons.extend(backend_reasons)
    broken = STATE.broken.get((cls.op_name, kind, spec.name))
    if broken is not None:
        reasons.append(f"failed at run time earlier: {broken}")
    return reasons


def guards(op: Declared, spec: PathSpec) -> bool:
    """Whether the op's non-finite rule applies to ``spec`` (it does not propagate NaN/inf
    as the meaning does)."""
    return bool(op.non_finite_inputs) and not spec.propagates_non_finite


def guarded_inputs(op: Declared, call: OpCall) -> list[torch.Tensor]:
    """The call's tensors named by ``non_finite_inputs``."""
    if isinstance(call, Args):
        found = [call.get(i) for i in op.non_finite_inputs]
    else:
        found = [getattr(call, str(n)) for n in op.non_finite_inputs]
    return [t for t in found if isinstance(t, torch.Tensor)]


def finite(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """0-d bool: no NaN/inf in ``tensors``. One ``aminmax`` per tensor: a single read, no
    temporary, no overflow (a sum in fp16 could overflow)."""
    flags = [torch.isfinite(torch.stack(torch.aminmax(t))).all() for t in tensors if t.numel()]
    return torch.stack(flags).all() if flags else torch.tensor(True)


def call_reasons(
    op: Declared,
    spec: PathSpec,
    kind: str,
    call: OpCall,
    tensors: list[torch.Tensor] | None = None,
) -> list[str]:
    """Why ``spec``, usable for ``kind``, cannot take this very call (empty: it can)."""
    reasons: list[str] = []
    needs_grad_check = spec.inference_only and torch.is_grad_enabled()
    if spec.dtypes is not None or needs_grad_check:
        tensors = call.tensors() if tensors is None else tensors
        if spec.dtypes is not None:
            for t in tensors:
                if t.dtype not in spec.dtypes and t.is_floating_point():
                    reasons.append(f"dtype {dtype_name(t.dtype)} not supported")
                    break
        if needs_grad_check and (
            any(t.requires_grad for t in tensors)
            or any(p.requires_grad for p in op.parameters(recurse=False))
        ):
            reasons.append("grad enabled: this path has no backward")
    if type(op).refuses:
        reasons.extend(op.not_supported(call))
    if spec.reasons is not None:
        reasons.extend(spec.reasons(call))
    if (
        op.non_finite_inputs
        and not reasons
        and kind == "cpu"  # elsewhere mend_non_finite, after the path: no host sync
        and guards(op, spec)
        and not traced()  # traced: a torch.cond instead
        and not bool(finite(guarded_inputs(op, call)))
    ):
        reasons.append(NON_FINITE_REASON)
    return reasons


registry.on_reset(forget)
