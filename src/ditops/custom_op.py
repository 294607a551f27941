"""CustomOp: one meaning per op, a fast path per device kind, chosen per call.

An op is an ``nn.Module`` registered under a unique name with :func:`register_op`.
It defines ``forward_native`` (the meaning, plain PyTorch) and any of
``forward_cpu``, ``forward_cuda``, ``forward_hip``, ``forward_xpu``, ``forward_npu``,
each decorated with :func:`fast_path` to say what it needs (a backend), what it
promises (precisions) and what it accepts (dtypes, inference only).

:meth:`CustomOp.dispatch` picks, for the device kind of the first tensor argument,
that kind's fast path when nothing rules it out, else ``forward_native``. What rules
a path out is kept as plain-language reasons, so :func:`explain` (and ``ditops info``)
can say why each path was or was not taken, the way xformers' dispatcher does.

The static part of a choice (config, backend probe, earlier failures) is cached per
(op, device kind, precision, settings); the per-call part (dtype, grad, the op's own
``fast_path_reasons``) is a few attribute reads. When a fast path raises at run time the
meaning runs on the same inputs: if it raises too, the caller's inputs are at fault and
its error is raised unchanged, with no state changed; if it succeeds, the backend is at
fault and the fast path is given up for that op and device kind (one warning per op and
backend), or, in strict mode (``DITOPS_STRICT=1``), :class:`BackendUnavailableError` is
raised. Strict mode raises the same error for a missing backend.

Under ``torch.compile`` the choice is made at trace time in plain Python and guarded on
the settings it read (see :meth:`CustomOp._dispatch_traced`); nothing on the dispatch
path takes a lock while a graph is traced.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import torch
from torch import nn

from ditops import config
from ditops.backends.base import Backend, all_backends
from ditops.platform import DEVICE_KINDS, device_kind
from ditops.tracing import trace_time_constant

logger = logging.getLogger("ditops")

NATIVE = "forward_native"


class BackendUnavailableError(RuntimeError):
    """Strict mode: a fast path could not be used. The message says why and what to install."""


@dataclass(frozen=True)
class PathSpec:
    """What a ``forward_<kind>`` needs, promises and accepts (set by :func:`fast_path`)."""

    backend: Backend | None = None
    precisions: frozenset[str] = frozenset({"fast"})
    dtypes: frozenset[torch.dtype] | None = None
    inference_only: bool = False
    propagates_non_finite: bool = False

    def accepts(self) -> str:
        """What this path takes, in words (for explanations)."""
        parts = [f"precision {'/'.join(sorted(self.precisions))}"]
        if self.dtypes is not None:
            names = sorted(str(d).replace("torch.", "") for d in self.dtypes)
            parts.append(f"dtypes {'/'.join(names)}")
        if self.inference_only:
            parts.append("inference only (no autograd)")
        if self.backend is not None:
            parts.append(f"needs {self.backend.name}")
        return ", ".join(parts)


F = TypeVar("F", bound=Callable[..., Any])


def fast_path(
    *,
    backend: Backend | None = None,
    precisions: Iterable[str] = ("fast",),
    dtypes: Iterable[torch.dtype] | None = None,
    inference_only: bool = False,
    propagates_non_finite: bool = False,
) -> Callable[[F], F]:
    """Declare a ``forward_<kind>`` method as a fast path.

    Args:
        backend: the optional library it calls; probed lazily, on first use.
        precisions: which of ``"fast"``/``"exact"`` this path honours. The path reads
            the one in force with :meth:`CustomOp.resolved_precision`.
        dtypes: dtypes the tensor arguments may have (``None``: any).
        inference_only: the path has no autograd support; it is skipped when a
            gradient is needed (grad mode on and an input or parameter requires grad).
        propagates_non_finite: tested to propagate NaN/inf exactly as the meaning does,
            so the op's ``meaning_for_non_finite`` check is not needed for this path.
    """
    precs = frozenset(precisions)
    bad = precs - set(config.PRECISIONS)
    if bad or not precs:
        raise ValueError(f"fast_path precisions must be a non-empty subset of {config.PRECISIONS}")
    spec = PathSpec(
        backend=backend,
        precisions=precs,
        dtypes=None if dtypes is None else frozenset(dtypes),
        inference_only=inference_only,
        propagates_non_finite=propagates_non_finite,
    )

    def decorate(fn: F) -> F:
        fn._ditops_path = spec  # type: ignore[attr-defined]
        return fn

    return decorate


@dataclass
class PathReport:
    """Why one path was or was not chosen."""

    path: str
    reasons: list[str] = field(default_factory=list)
    accepts: str = ""

    @property
    def usable(self) -> bool:
        return not self.reasons


@dataclass
class Decision:
    """The static choice for one (op, device kind, precision)."""

    op: str
    device_kind: str
    precision: str
    chosen: str
    candidates: list[PathReport]

    def as_dict(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "device_kind": self.device_kind,
            "precision": self.precision,
            "chosen": self.chosen,
            "candidates": [
                {"path": c.path, "usable": c.usable, "reasons": c.reasons, "accepts": c.accepts}
                for c in self.candidates
            ],
        }


# --- process-wide state -----------------------------------------------------------------

_registry: dict[str, type[CustomOp]] = {}
_state_lock = threading.Lock()
# (op name, device kind) -> why its fast path was given up at run time.
_broken: dict[tuple[str, str], str] = {}
# (op name, backend name) pairs already warned about.
_warned: set[tuple[str, str]] = set()
# Bumped when _broken changes, so cached plans are recomputed.
_state_version = 0


def register_op(name: str) -> Callable[[type[C]], type[C]]:
    """Class decorator: register a CustomOp subclass under a unique name."""
    if not name or not name.replace("_", "").isalnum():
        raise ValueError(f"op names are identifiers made of letters, digits and '_', got {name!r}")

    def decorate(cls: type[C]) -> type[C]:
        if not (isinstance(cls, type) and issubclass(cls, CustomOp)):
            raise TypeError(f"register_op({name!r}) decorates CustomOp subclasses, got {cls!r}")
        existing = _registry.get(name)
        if existing is not None and existing is not cls:
            raise ValueError(
                f"an op named {name!r} is already registered ({existing.__module__}."
                f"{existing.__qualname__}); op names must be unique"
            )
        cls.op_name = name
        cls._plans = {}
        _registry[name] = cls
        return cls

    return decorate


def registered_ops() -> dict[str, type[CustomOp]]:
    """All registered op classes by name."""
    return dict(_registry)


def reset_state() -> None:
    """Forget backend probes, run-time failures, warnings given and cached plans.

    For tests that install or remove (fake) packages within one process.
    """
    global _state_version
    with _state_lock:
        _broken.clear()
        _warned.clear()
        _state_version += 1
    for backend in all_backends():
        backend.reset()
    for cls in _registry.values():
        cls._plans = {}


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
    for a in kwargs.values():
        if isinstance(a, torch.Tensor):
            return a
    return None


def _tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterable[torch.Tensor]:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a


#: The reason a call with NaN/inf in a guarded input runs the meaning.
NON_FINITE_REASON = "an input holds NaN or inf: the meaning runs, so they propagate as in it"


def _finite(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """0-d bool: no NaN/inf in ``tensors``.

    One ``aminmax`` per tensor: a single read, no temporary, no overflow (a sum in the
    tensor's dtype could overflow fp16; an fp32 sum of bf16 is 10x slower on CPU).
    Measured at bf16 [1, 12, 8192, 128] on the project CPU: 8 ms per tensor, about half a
    clone. Reading the flag on an accelerator waits for its queue.
    """
    flags = [torch.isfinite(torch.stack(torch.aminmax(t))).all() for t in tensors if t.numel()]
    if not flags:
        return torch.tensor(True)
    return torch.stack(flags).all()


@dataclass(frozen=True)
class _Plan:
    method: Callable[..., Any] | None  # the fast path to try, or None for native
    spec: PathSpec | None
    decision: Decision


C = TypeVar("C", bound="CustomOp")


class CustomOp(nn.Module):
    """Base class of every ditops op. See the module docstring."""

    op_name: ClassVar[str] = ""
    _plans: ClassVar[dict[tuple[Any, ...], _Plan]] = {}
    #: Positions of the tensor arguments whose NaN/inf must reach the output as the
    #: meaning propagates them, where fast kernels may not (attention kernels turn a NaN
    #: query row into zeros). A call with non-finite values there runs the meaning.
    meaning_for_non_finite: ClassVar[tuple[int, ...]] = ()
    _precision: str | None = None

    @property
    def precision(self) -> str | None:
        """Per-module precision, ``"fast"``/``"exact"``; ``None`` follows the settings
        (``DITOPS_PRECISION``). Checked when set: anything else raises ValueError."""
        return self._precision

    @precision.setter
    def precision(self, value: str | None) -> None:
        if value is not None and (not isinstance(value, str) or value not in config.PRECISIONS):
            raise ValueError(
                f"{type(self).__name__}.precision must be 'fast', 'exact' or None, got {value!r}"
            )
        self._precision = value

    # -- what subclasses provide ----------------------------------------------------------

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must define forward_native")

    def fast_path_reasons(self, kind: str, *args: Any, **kwargs: Any) -> list[str]:
        """Op-specific reasons the fast path for ``kind`` cannot take these inputs."""
        return []

    def output_shape(self, *args: Any, **kwargs: Any) -> tuple[int, ...]:
        """The shape of the one output tensor (ops with ``meaning_for_non_finite`` only:
        compiled, their non-finite choice is a ``torch.cond`` over flat outputs)."""
        raise NotImplementedError(f"{type(self).__name__} must define output_shape")

    # -- dispatch -------------------------------------------------------------------------

    def resolved_precision(self) -> str:
        """The precision this call must honour: the module's, else the process setting."""
        return self.precision or config.get().precision

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.dispatch(*args, **kwargs)

    def dispatch(self, *args: Any, **kwargs: Any) -> Any:
        """Run the best usable path for these inputs' device kind."""
        first = _first_tensor(args, kwargs)
        kind = device_kind(first) if first is not None else "cpu"
        if torch.compiler.is_compiling():
            return self._dispatch_traced(kind, args, kwargs)
        plan = self._plan(kind, self.precision)
        if plan.method is None or self._call_reasons(plan.spec, kind, args, kwargs):
            return self.forward_native(*args, **kwargs)
        try:
            return plan.method(self, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - classified below: caller's error or backend's
            return self._after_failure(kind, plan.spec, exc, args, kwargs)

    def _after_failure(
        self,
        kind: str,
        spec: PathSpec | None,
        exc: Exception,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """A fast path raised: whose fault is it?

        The meaning runs on the same inputs. If it raises too, the inputs are at fault
        (a device mix-up, a wrong shape the checks let through): its error is raised as
        the meaning raises it, and nothing changes, so one mistake never turns a fast
        path off for the process. If it succeeds, the backend is at fault: the path is
        given up for this device kind (one warning) and the meaning's result returned;
        strict mode raises :class:`BackendUnavailableError` instead.
        """
        try:
            result = self.forward_native(*args, **kwargs)
        except Exception as native_exc:  # noqa: BLE001 - re-raised as it is
            raise native_exc.with_traceback(native_exc.__traceback__) from None
        self._give_up(kind, spec, exc)
        return result

    def _dispatch_traced(self, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Dispatch inside ``torch.compile``: the choice becomes part of the graph.

        The static choice is made in plain Python at trace time (:func:`_traced_choice`:
        no lock, probe or warning is ever traced) and the graph is guarded on the values
        it depended on (the module's precision, the thread's settings), so changing them
        recompiles. A fast path's failure here is a compile error, not a fallback: its
        kernels are opaque custom ops, traced into the graph.
        """
        config.ensure_loaded()
        cfg = config.get()
        precision = self.precision or cfg.precision
        name = _traced_choice(type(self), kind, precision, cfg.custom_ops.text, cfg.strict)
        if name == NATIVE:
            return self.forward_native(*args, **kwargs)
        method = getattr(type(self), name)
        if self._call_reasons(method._ditops_path, kind, args, kwargs):
            return self.forward_native(*args, **kwargs)
        if not self.meaning_for_non_finite or method._ditops_path.propagates_non_finite:
            return method(self, *args, **kwargs)
        # No data-dependent Python branch in a graph: torch.cond picks the meaning when a
        # guarded input holds NaN/inf.
        positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

        def rebuild(tensors: tuple[torch.Tensor, ...]) -> list[Any]:
            full = list(args)
            for i, t in zip(positions, tensors):
                full[i] = t
            return full

        # torch.cond must prove its outputs' strides dense, which it cannot for symbolic
        # sizes (a new resolution recompiles with dynamic shapes: a contiguous stride is
        # Max(1, size)): the branches return the output flat, shaped back after.
        shape = self.output_shape(*args, **kwargs)

        def flat(fn: Callable[..., Any]) -> Callable[..., Any]:
            return lambda *ts: fn(*rebuild(ts), **kwargs).contiguous().reshape(-1)

        out = torch.cond(
            _finite(self._guarded_tensors(args)),
            flat(lambda *a, **k: method(self, *a, **k)),
            flat(self.forward_native),
            tuple(args[i] for i in positions),
        )
        return out.view(shape)

    def _call_reasons(
        self, spec: PathSpec | None, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> list[str]:
        reasons: list[str] = []
        if spec is not None and spec.dtypes is not None:
            for t in _tensors(args, kwargs):
                if t.is_floating_point() and t.dtype not in spec.dtypes:
                    reasons.append(f"dtype {str(t.dtype).replace('torch.', '')} not supported")
                    break
        if spec is not None and spec.inference_only and torch.is_grad_enabled():
            needs_grad = any(t.requires_grad for t in _tensors(args, kwargs)) or any(
                p.requires_grad for p in self.parameters(recurse=False)
            )
            if needs_grad:
                reasons.append("grad enabled: this path has no backward")
        reasons.extend(self.fast_path_reasons(kind, *args, **kwargs))
        if (
            not reasons
            and self.meaning_for_non_finite
            and not (spec is not None and spec.propagates_non_finite)
            and not torch.compiler.is_compiling()  # traced: a torch.cond instead
            and not bool(_finite(self._guarded_tensors(args)))
        ):
            reasons.append(NON_FINITE_REASON)
        return reasons

    def _guarded_tensors(self, args: tuple[Any, ...]) -> list[torch.Tensor]:
        return [args[i] for i in self.meaning_for_non_finite if i < len(args)]

    def _give_up(self, kind: str, spec: PathSpec | None, exc: Exception) -> None:
        global _state_version
        backend = spec.backend.name if spec is not None and spec.backend is not None else kind
        hint = spec.backend.install_hint if spec is not None and spec.backend is not None else ""
        why = f"forward_{kind} raised {type(exc).__name__}: {exc}"
        if config.get().strict:
            raise BackendUnavailableError(
                f"ditops op {self.op_name!r}: {why} (strict mode: not falling back). "
                f"Unset DITOPS_STRICT to fall back to forward_native. {hint}"
            ) from exc
        with _state_lock:
            _broken[(self.op_name, kind)] = why
            _state_version += 1
        self._warn_once(backend, f"{why}; using forward_native from now on for {kind} tensors")

    @classmethod
    def _warn_once(cls, backend: str, message: str) -> None:
        """One warning per (op, backend) per process."""
        key = (cls.op_name, backend)
        with _state_lock:
            if key in _warned:
                return
            _warned.add(key)
        logger.warning("ditops op %r falls back to forward_native: %s", cls.op_name, message)

    @classmethod
    def _plan(cls, kind: str, module_precision: str | None) -> _Plan:
        """The cached plan for ``kind`` under the module's precision (None: the process's)."""
        cfg = config.get()  # read once per call: it also gives the precision
        precision = module_precision or cfg.precision
        # Keyed by the settings' values, not their version: a block under
        # config.override(...) with the same values reuses the plans (no growth per call).
        key = (kind, precision, cfg.custom_ops, cfg.strict, _state_version)
        plan = cls._plans.get(key)
        if plan is None:
            plan = cls._make_plan(kind, precision, cfg)
            cls._plans[key] = plan
        return plan

    @classmethod
    def _make_plan(
        cls, kind: str, precision: str, cfg: config.Config, quiet: bool = False
    ) -> _Plan:
        """Decide from config, backend probe and past failures. ``quiet``: for explanations
        (no warning, no strict error, nothing cached)."""
        cfg.custom_ops.check_names(_registry)
        name = f"forward_{kind}"
        method = getattr(cls, name, None)
        spec: PathSpec | None = getattr(method, "_ditops_path", None)
        candidates: list[PathReport] = []
        if method is None or spec is None:
            decision = Decision(
                cls.op_name,
                kind,
                precision,
                NATIVE,
                [PathReport(name, [f"ditops has no {kind} fast path for this op"])],
            )
            return _Plan(None, None, decision)
        reasons: list[str] = []
        if not cfg.custom_ops.is_enabled(cls.op_name):
            reasons.append(f"disabled by DITOPS_CUSTOM_OPS={cfg.custom_ops.text!r}")
        if precision not in spec.precisions:
            gives = "/".join(sorted(spec.precisions))
            reasons.append(f"does not promise precision={precision!r} (it gives {gives})")
        if not reasons and spec.backend is not None:
            backend_reasons = spec.backend.probe()
            if backend_reasons:
                reasons.extend(backend_reasons)
                message = "; ".join(backend_reasons)
                if cfg.strict and not quiet:
                    raise BackendUnavailableError(
                        f"ditops op {cls.op_name!r}: {name} cannot run: {message} "
                        "(strict mode: not falling back; unset DITOPS_STRICT to fall back)"
                    )
                if not quiet:
                    cls._warn_once(spec.backend.name, message)
        broken = _broken.get((cls.op_name, kind))
        if broken is not None:
            reasons.append(f"failed at run time earlier: {broken}")
        candidates.append(PathReport(name, reasons, spec.accepts()))
        chosen = NATIVE if reasons else name
        decision = Decision(cls.op_name, kind, precision, chosen, candidates)
        return _Plan(None if reasons else method, spec, decision)

    def explain_call(self, *args: Any, **kwargs: Any) -> Decision:
        """The choice :meth:`dispatch` would make for these very inputs, with reasons."""
        first = _first_tensor(args, kwargs)
        kind = device_kind(first) if first is not None else "cpu"
        plan = self._plan(kind, self.precision)
        decision = plan.decision
        if plan.method is not None:
            call = self._call_reasons(plan.spec, kind, args, kwargs)
            if call:
                report = PathReport(
                    decision.candidates[0].path, call, decision.candidates[0].accepts
                )
                decision = Decision(decision.op, kind, decision.precision, NATIVE, [report])
        return decision


@trace_time_constant
def _traced_choice(
    cls: type[CustomOp], kind: str, precision: str, custom_ops: str, strict: bool
) -> str:
    """The path ``cls`` takes for ``kind`` (a method name), for a graph being traced.

    Runs as plain Python at trace time (:func:`ditops.tracing.trace_time_constant`).
    ``custom_ops`` and ``strict`` are not read here (the plan reads the thread's
    settings): passing them makes the graph guard on their values.
    """
    return cls._plan(kind, precision).decision.chosen


def explain(
    op: str | None = None,
    device_kinds: Iterable[str] | None = None,
    precision: str | None = None,
) -> list[Decision]:
    """For every registered op (or ``op``) and device kind, the path that would run and why.

    Probing happens here if it has not yet (it imports optional packages). In strict
    mode a missing backend is reported, not raised.
    """
    names = [op] if op is not None else sorted(_registry)
    for n in names:
        if n not in _registry:
            raise KeyError(f"no op named {n!r}; registered ops are: {', '.join(sorted(_registry))}")
    kinds = list(device_kinds) if device_kinds is not None else list(DEVICE_KINDS)
    prec = precision or config.get().precision
    if prec not in config.PRECISIONS:
        raise ValueError(f"precision must be one of {config.PRECISIONS}, got {prec!r}")
    cfg = config.get()
    return [
        _registry[n]._make_plan(kind, prec, cfg, quiet=True).decision
        for n in names
        for kind in kinds
    ]
