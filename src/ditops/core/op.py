"""CustomOp: one meaning per op, declared paths per device kind, chosen per call.

An op is an ``nn.Module`` registered under a unique name with :func:`register_op`. It
declares its call once, ``prepare(...)``, which validates and normalises the arguments
into a call record (:mod:`ditops.core.calls`); its meaning, ``forward_native(call)``, in
plain PyTorch; and any number of paths, methods decorated with
:func:`ditops.core.paths.path`, each saying which device kinds it serves and what it
needs, promises and refuses.

A call (``op(...)``) is prepared once, then :meth:`CustomOp.run` takes, for the device
kind of the call's first tensor, the first declared path that nothing rules out, else the
meaning. What rules a path out is kept as plain-language reasons, so
:func:`ditops.core.explain.explain` and ``ditops info`` say why, the way xformers'
dispatcher does. The static part (config, backend probe, earlier failures) is cached per
(op, device kind, precision, settings); the per-call part (dtypes, grad, the path's and
the op's reasons) reads the record.

When a path raises, the meaning runs on the same call: if it raises too the caller's
inputs are at fault and its error is raised unchanged, with no state changed; if not, the
path is given up for that op and device kind (one warning per op and backend), or, in
strict mode (``DITOPS_STRICT=1``), :class:`BackendUnavailableError` is raised.

**NaN and inf** (:attr:`CustomOp.non_finite_inputs`): paths that do not propagate them as
the meaning does are guarded. On CPU the guarded inputs are checked before the path (a
flag in host memory: no device waits) and such a call runs the meaning; on an
accelerator nothing is read back: the op's :meth:`CustomOp.mend_non_finite` puts, on the
device, NaN where non-finite inputs reach the output. Compiled, the CPU check is a
``torch.cond``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import torch
from torch import nn

from ditops import config
from ditops.core import registry, same_bits, tune
from ditops.core.calls import Args, OpCall, invoke
from ditops.core.checks import check_precision, dtype_name
from ditops.core.paths import NATIVE, Decision, PathReport, PathSpec, runner
from ditops.core.registry import STATE, finite, registered_ops
from ditops.core.traced import run_traced
from ditops.platform import device_kind
from ditops.tracing import traced

logger = logging.getLogger("ditops")


class BackendUnavailableError(RuntimeError):
    """Strict mode: a fast path could not be used. The message says why and what to install."""


#: The reason a CPU call with NaN/inf in a guarded input runs the meaning.
NON_FINITE_REASON = "an input holds NaN or inf: the meaning runs, so they propagate as in it"

C = TypeVar("C", bound="CustomOp")

#: Hooks of the former op core, and what declares the same now.
_RETIRED = {
    "fast_path_reasons": "give each path reasons=fn(call), or the op not_supported(call)",
    "meaning_for_non_finite": "declare non_finite_inputs (field names) and mend_non_finite",
    "dispatch": "ops are called (op(...)) or run a prepared call (op.run(call))",
}


def register_op(name: str) -> Callable[[type[C]], type[C]]:
    """Class decorator: register a CustomOp subclass under a unique name."""
    if not name or not name.replace("_", "").isalnum():
        raise ValueError(f"op names are identifiers made of letters, digits and '_', got {name!r}")

    def decorate(cls: type[C]) -> type[C]:
        if not (isinstance(cls, type) and issubclass(cls, CustomOp)):
            raise TypeError(f"register_op({name!r}) decorates CustomOp subclasses, got {cls!r}")
        registry.add(name, cls)
        cls.op_name = name
        cls._plans = {}
        return cls

    return decorate


@dataclass(frozen=True)
class _Plan:
    paths: tuple[tuple[PathSpec, Callable[[CustomOp, OpCall], Any]], ...]  # usable, in order
    exact: bool
    decision: Decision
    # What DITOPS_TUNE times against each other (paths, then the meaning), when it may.
    competitors: tuple[str, ...] = ()


class CustomOp(nn.Module):
    """Base class of every ditops op. See the module docstring."""

    op_name: ClassVar[str] = ""
    _plans: ClassVar[dict[tuple[Any, ...], _Plan]] = {}
    _specs: ClassVar[dict[str, PathSpec]] = {}
    _by_kind: ClassVar[dict[str, tuple[PathSpec, ...]]] = {}
    _native: ClassVar[Callable[..., Any] | None] = None
    #: The call-record fields (positions, for :class:`Args` ops) whose NaN/inf must reach
    #: the output as the meaning propagates them, where fast kernels may not (attention
    #: kernels turn a NaN query row into zeros). See the module docstring.
    non_finite_inputs: ClassVar[tuple[int | str, ...]] = ()
    #: Whether the meaning competes when paths are timed (:mod:`ditops.core.tune`); an op
    #: whose meaning is a memory-bounded oracle, never a contender, says False.
    meaning_competes: ClassVar[bool] = True
    _precision: str | None = None
    _answers_early: ClassVar[bool] = False
    _refuses: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for old, new in _RETIRED.items():  # an op written for the old core fails loudly
            if old in cls.__dict__:
                raise TypeError(f"{cls.__name__}.{old} is no longer read: {new}")
        cls._plans = {}  # each class its own: plans hold its paths
        # Hooks left as the base defines them are not called per call.
        cls._answers_early = cls.answer_without_paths is not CustomOp.answer_without_paths
        cls._refuses = cls.not_supported is not CustomOp.not_supported
        native = cls.__dict__.get("forward_native")
        if native is not None:
            cls._native = native

            def forward_native(self: CustomOp, *args: Any, **kw: Any) -> Any:
                return invoke(type(self)._native, self, self._as_call(args, kw))  # type: ignore[arg-type]

            forward_native.__doc__ = native.__doc__
            cls.forward_native = forward_native  # type: ignore[method-assign]
        specs: dict[str, PathSpec] = {}
        for klass in reversed(cls.__mro__):
            for name, attr in vars(klass).items():
                spec = getattr(attr, "_ditops_path", None)
                if spec is not None and name != spec.name:
                    raise TypeError(
                        f"{cls.__name__}.{name} = {spec.name}: declare the device kinds a "
                        f"path serves instead, @path({', '.join(map(repr, spec.kinds))}, ...)"
                    )
                if spec is not None:
                    specs[name] = spec
                elif name in specs:
                    del specs[name]  # overridden by a plain method
        cls._specs = specs
        by_kind: dict[str, list[PathSpec]] = {}
        for spec in specs.values():
            for kind in spec.kinds:
                by_kind.setdefault(kind, []).append(spec)
                if getattr(cls, f"forward_{kind}", None) is None:  # forward_<kind> names it
                    setattr(cls, f"forward_{kind}", getattr(cls, spec.name))
        cls._by_kind = {k: tuple(v) for k, v in by_kind.items()}
        unguarded = [s.name for s in specs.values() if not s.propagates_non_finite]
        if cls.non_finite_inputs and unguarded and cls.mend_non_finite is CustomOp.mend_non_finite:
            raise TypeError(
                f"{cls.__name__} declares non_finite_inputs: define mend_non_finite(call, out) "
                f"(on an accelerator {', '.join(unguarded)} run and it puts NaN where the "
                "meaning has it; no value is read back), or mark the paths "
                "propagates_non_finite=True"
            )

    @property
    def precision(self) -> str | None:
        """Per-module precision, ``"fast"``/``"exact"``; ``None`` follows the settings
        (``DITOPS_PRECISION``). Checked when set: anything else raises ValueError."""
        return self._precision

    @precision.setter
    def precision(self, value: str | None) -> None:
        self._precision = check_precision(value, f"{type(self).__name__}.precision")

    # -- what subclasses provide ----------------------------------------------------------

    def prepare(self, *args: Any, **kwargs: Any) -> OpCall:
        """Validate and normalise one call (TypeError/ValueError saying what is wrong and
        what is expected) into the op's call record. Default: the arguments as given."""
        return Args(args, kwargs)

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must define forward_native")

    def not_supported(self, call: Any) -> list[str]:
        """Reasons no path of this op can take this call (an empty sequence...)."""
        return []

    def answer_without_paths(self, call: Any) -> Any:
        """A result that needs no computation (or None): returned before any dispatch."""
        return None

    def mend_non_finite(self, call: Any, out: Any) -> Any:
        """On the device, NaN where the call's non-finite inputs reach ``out``."""
        raise NotImplementedError

    def output_shape(self, call: Any) -> tuple[int, ...]:
        """The shape of the one output (ops with ``non_finite_inputs``: compiled on CPU,
        their non-finite choice is a ``torch.cond`` over flat outputs)."""
        raise NotImplementedError(f"{type(self).__name__} must define output_shape")

    # -- dispatch -------------------------------------------------------------------------

    def resolved_precision(self) -> str:
        """The precision this op honours: the module's, else the process setting."""
        return self._precision or config.get().precision

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(self.prepare(*args, **kwargs))

    def _as_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> OpCall:
        if len(args) == 1 and not kwargs and isinstance(args[0], OpCall):
            return args[0]
        return self.prepare(*args, **kwargs)

    def run_path(self, spec: PathSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run one path directly (a test's call of ``op.forward_cpu(...)``), no dispatch."""
        call = self._as_call(args, kwargs)
        call.exact = self.resolved_precision() == "exact"
        return invoke(spec.fn, self, call)

    def run(self, call: OpCall, precision: str | None = None) -> Any:
        """Run the best usable path for this prepared call; ``precision`` overrides the
        module's (a norm module passes its own)."""
        if self._answers_early:
            early = self.answer_without_paths(call)
            if early is not None:
                return early
        tensors = call.tensors()  # once: the device kind and every path's checks read them
        kind = device_kind(tensors[0]) if tensors else "cpu"
        if traced():
            return run_traced(self, kind, call, precision or self._precision)
        plan = self._plan(kind, precision or self._precision)
        if plan.competitors:  # DITOPS_TUNE: the class's measured winner, or time them now
            out = tune.dispatch(self, kind, plan, call, tensors)
            if out is not tune.STATIC:
                return out
        for spec, fn in plan.paths:
            if self._call_reasons(spec, kind, call, tensors):
                continue
            call.exact = plan.exact
            return self._run_path(kind, spec, fn, call)
        return invoke(type(self)._native, self, call)  # type: ignore[arg-type]

    def _run_path(
        self, kind: str, spec: PathSpec, fn: Callable[[CustomOp, OpCall], Any], call: OpCall
    ) -> Any:
        """Run one usable path on a call: the meaning if it raises (:meth:`_after_failure`),
        the non-finite mend on accelerators."""
        try:
            out = fn(self, call)
        except Exception as exc:  # noqa: BLE001 - classified: caller's error or backend's
            return self._after_failure(kind, spec, exc, call)
        if kind != "cpu" and self.non_finite_inputs and not spec.propagates_non_finite:
            return self.mend_non_finite(call, out)
        return out

    @staticmethod
    def _kind(call: OpCall) -> str:
        first = call.first_tensor()
        return device_kind(first) if first is not None else "cpu"

    def _guards(self, spec: PathSpec, kind: str) -> bool:
        return bool(self.non_finite_inputs) and not spec.propagates_non_finite

    def _mended(self, spec: PathSpec, kind: str, call: OpCall, out: Any) -> Any:
        if kind != "cpu" and self._guards(spec, kind):
            return self.mend_non_finite(call, out)
        return out

    def _guarded(self, call: OpCall) -> list[torch.Tensor]:
        if isinstance(call, Args):
            found = [call.get(i) for i in self.non_finite_inputs]
        else:
            found = [getattr(call, str(n)) for n in self.non_finite_inputs]
        return [t for t in found if isinstance(t, torch.Tensor)]

    def _after_failure(self, kind: str, spec: PathSpec, exc: Exception, call: OpCall) -> Any:
        """A path raised: the meaning runs on the same call. If it raises too, the inputs
        are at fault: its error is raised as it is and nothing changes. If not, the path
        is given up for this device kind (one warning; strict mode raises)."""
        try:
            result = invoke(type(self)._native, self, call)  # type: ignore[arg-type]
        except Exception as native_exc:  # noqa: BLE001 - re-raised as it is
            raise native_exc.with_traceback(native_exc.__traceback__) from None
        self._give_up(kind, spec, exc)
        return result

    def _call_reasons(
        self, spec: PathSpec, kind: str, call: OpCall, tensors: list[torch.Tensor] | None = None
    ) -> list[str]:
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
                or any(p.requires_grad for p in self.parameters(recurse=False))
            ):
                reasons.append("grad enabled: this path has no backward")
        if self._refuses:
            reasons.extend(self.not_supported(call))
        if spec.reasons is not None:
            reasons.extend(spec.reasons(call))
        if (
            self.non_finite_inputs
            and not reasons
            and kind == "cpu"  # elsewhere mend_non_finite, after the path: no host sync
            and self._guards(spec, kind)
            and not traced()  # traced: a torch.cond instead
            and not bool(finite(self._guarded(call)))
        ):
            reasons.append(NON_FINITE_REASON)
        return reasons

    def _give_up(self, kind: str, spec: PathSpec, exc: Exception) -> None:
        backend = spec.backend.name if spec.backend is not None else kind
        hint = spec.backend.install_hint if spec.backend is not None else ""
        why = f"{spec.name} raised {type(exc).__name__}: {exc}"
        if config.get().strict:
            raise BackendUnavailableError(
                f"ditops op {self.op_name!r}: {why} (strict mode: not falling back). "
                f"Unset DITOPS_STRICT to fall back to forward_native. {hint}"
            ) from exc
        with STATE.lock:
            STATE.broken[(self.op_name, kind, spec.name)] = why
            STATE.version += 1
        rest = [s.name for s in self._by_kind.get(kind, ()) if s is not spec]
        after = f"the next usable of {', '.join(rest)}, else forward_native" if rest else NATIVE
        self._warn_once(
            backend, f"{why}; this call ran forward_native, later {kind} calls run {after}"
        )

    @classmethod
    def _warn_once(cls, backend: str, message: str) -> None:
        """One warning per (op, backend) per process."""
        key = (cls.op_name, backend)
        with STATE.lock:
            if key in STATE.warned:
                return
            STATE.warned.add(key)
        logger.warning("ditops op %r falls back to forward_native: %s", cls.op_name, message)

    @classmethod
    def _plan(cls, kind: str, module_precision: str | None) -> _Plan:
        """The cached plan for ``kind`` under the module's precision (None: the process's)."""
        cfg = config.get()
        precision = module_precision or cfg.precision
        # Keyed by the settings' values, not their version: a block under
        # config.override(...) with the same values reuses the plans. The selection by its
        # text (it is parsed from it): a str hashes once, a dataclass on every call.
        key = (kind, precision, cfg.custom_ops.text, cfg.strict, cfg.tune, STATE.version)
        plan = cls._plans.get(key)
        if plan is None:
            plan = cls._plans[key] = cls._make_plan(kind, precision, cfg)
        return plan

    @classmethod
    def _make_plan(
        cls, kind: str, precision: str, cfg: config.Config, quiet: bool = False
    ) -> _Plan:
        """Decide from config, backend probes and past failures. ``quiet``: for
        explanations (no warning, no strict error)."""
        cfg.custom_ops.check_names(registered_ops())
        specs = cls._by_kind.get(kind, ())
        if not specs:
            report = PathReport(f"forward_{kind}", [f"ditops has no {kind} fast path for this op"])
            return _Plan((), False, Decision(cls.op_name, kind, precision, NATIVE, [report]))
        candidates: list[PathReport] = []
        usable: list[PathSpec] = []
        for spec in specs:
            reasons = cls._static_reasons(spec, kind, precision, cfg, quiet)
            candidates.append(PathReport(spec.name, reasons, spec.accepts(), spec.per_call))
            if not reasons:
                usable.append(spec)
        chosen = usable[0].name if usable else NATIVE
        decision = Decision(cls.op_name, kind, precision, chosen, candidates)
        unpack = cls.prepare is CustomOp.prepare  # no record type: the arguments as given
        routes = tuple((spec, runner(cls, spec, unpack)) for spec in usable)
        # Only paths giving the same bits compete: timing never changes a result.
        same = same_bits.competitors(usable, precision, cls.meaning_competes)
        competitors = same if cfg.tune != "off" else ()
        return _Plan(routes, precision == "exact", decision, competitors)

    @classmethod
    def _static_reasons(
        cls, spec: PathSpec, kind: str, precision: str, cfg: config.Config, quiet: bool
    ) -> list[str]:
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
                cls._warn_once(spec.backend.name, message)
            reasons.extend(backend_reasons)
        broken = STATE.broken.get((cls.op_name, kind, spec.name))
        if broken is not None:
            reasons.append(f"failed at run time earlier: {broken}")
        return reasons

    def explain_call(self, *args: Any, **kwargs: Any) -> Decision:
        """The choice :meth:`run` would make for these very inputs, with reasons."""
        return self.explain_prepared(self._as_call(args, kwargs))

    def explain_prepared(self, call: OpCall, precision: str | None = None) -> Decision:
        """:meth:`explain_call` for a prepared call (``precision``: as :meth:`run`)."""
        kind = self._kind(call)
        plan = self._plan(kind, precision or self._precision)
        base = plan.decision
        candidates: list[PathReport] = []
        chosen = NATIVE
        for report in base.candidates:
            spec = type(self)._specs.get(report.path)
            reasons = list(report.reasons)
            if not reasons and spec is not None:
                reasons = self._call_reasons(spec, kind, call)
            candidates.append(PathReport(report.path, reasons, report.accepts))
            if not reasons and chosen == NATIVE:
                chosen = report.path
        tuned = tune.recorded(self, kind, plan, call) if plan.competitors else None
        if tuned is not None and (
            tuned.winner == NATIVE or any(c.path == tuned.winner and c.usable for c in candidates)
        ):
            return Decision(base.op, kind, base.precision, tuned.winner, candidates, tuned.why())
        return Decision(base.op, kind, base.precision, chosen, candidates)
