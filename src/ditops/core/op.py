"""CustomOp: one meaning per op, declared paths per device kind, chosen per call.

An op is an ``nn.Module`` registered under a unique name with :func:`register_op`. It
declares its call once, ``prepare(...)``, which validates and normalises the arguments
into a call record (:mod:`ditops.core.calls`); its meaning, ``forward_native(call)``, in
plain PyTorch; and any number of paths, methods decorated with
:func:`ditops.core.paths.path`, each saying which device kinds it serves and what it
needs, promises and refuses.

This class is the declaration; the dispatcher (:func:`ditops.core.dispatch.run`) reads it.
A call (``op(...)``) is prepared once, then, for the device kind of the call's first
tensor, the first declared path that nothing rules out runs, else the meaning. What rules
a path out is kept as plain-language reasons, so :func:`ditops.core.explain.explain` and
``ditops info`` say why, the way xformers' dispatcher does. A path that raises falls back
to the meaning (:mod:`ditops.core.fallback`; strict mode, ``DITOPS_STRICT=1``, raises
:class:`BackendUnavailableError`).

**NaN and inf** (:attr:`CustomOp.non_finite_inputs`): paths that do not propagate them as
the meaning does are guarded. On CPU the guarded inputs are checked before the path (a
flag in host memory: no device waits) and such a call runs the meaning; on an
accelerator nothing is read back: the op's :meth:`CustomOp.mend_non_finite` puts, on the
device, NaN where non-finite inputs reach the output. Compiled, the CPU check is a
``torch.cond``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

from torch import nn

from ditops import config
from ditops.core import dispatch, registry
from ditops.core.calls import Args, OpCall, invoke
from ditops.core.checks import check_precision
from ditops.core.paths import Decision, PathSpec
from ditops.core.plan import NON_FINITE_REASON, BackendUnavailableError

__all__ = ["NON_FINITE_REASON", "BackendUnavailableError", "CustomOp", "register_op"]

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
        return cls

    return decorate


class CustomOp(nn.Module):
    """Base class of every ditops op. See the module docstring."""

    op_name: ClassVar[str] = ""
    #: The declared paths by method name, in declaration order, and per device kind
    #: (made from the ``@path`` methods when the class is defined).
    declared_paths: ClassVar[dict[str, PathSpec]] = {}
    paths_by_kind: ClassVar[dict[str, tuple[PathSpec, ...]]] = {}
    #: ``forward_native`` as the class wrote it (the method is wrapped to prepare calls).
    meaning: ClassVar[Callable[..., Any]]
    #: The call-record fields (positions, for :class:`Args` ops) whose NaN/inf must reach
    #: the output as the meaning propagates them, where fast kernels may not (attention
    #: kernels turn a NaN query row into zeros). See the module docstring.
    non_finite_inputs: ClassVar[tuple[int | str, ...]] = ()
    #: Whether the meaning competes when paths are timed (:mod:`ditops.core.tune`); an op
    #: whose meaning is a memory-bounded oracle, never a contender, says False.
    meaning_competes: ClassVar[bool] = True
    #: Whether a small CPU call (:data:`ditops.core.plan.SMALL_CALL_ELEMENTS`) runs the
    #: meaning, which costs less there than a path's call; an op whose path's result is
    #: a choice (a mask estimate's near-ties) says False, as does one whose meaning
    #: does not compete.
    small_calls_run_meaning: ClassVar[bool] = True
    _precision: str | None = None
    #: Read by the dispatcher: hooks left as the base defines them are not called per
    #: call, and an op without a record type gets the arguments as given.
    answers_early: ClassVar[bool] = False
    refuses: ClassVar[bool] = False
    takes_arguments: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for old, new in _RETIRED.items():  # an op written for the old core fails loudly
            if old in cls.__dict__:
                raise TypeError(f"{cls.__name__}.{old} is no longer read: {new}")
        cls.answers_early = cls.answer_without_paths is not CustomOp.answer_without_paths
        cls.refuses = cls.not_supported is not CustomOp.not_supported
        cls.takes_arguments = cls.prepare is CustomOp.prepare
        native = cls.__dict__.get("forward_native")
        if native is not None:
            cls.meaning = native

            def forward_native(self: CustomOp, *args: Any, **kw: Any) -> Any:
                return invoke(type(self).meaning, self, self._as_call(args, kw))

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
        cls.declared_paths = specs
        by_kind: dict[str, list[PathSpec]] = {}
        for spec in specs.values():
            for kind in spec.kinds:
                by_kind.setdefault(kind, []).append(spec)
                if getattr(cls, f"forward_{kind}", None) is None:  # forward_<kind> names it
                    setattr(cls, f"forward_{kind}", getattr(cls, spec.name))
        cls.paths_by_kind = {k: tuple(v) for k, v in by_kind.items()}
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
        module's (a norm module passes its own). See :func:`ditops.core.dispatch.run`."""
        return dispatch.run(self, call, precision)

    def explain_call(self, *args: Any, **kwargs: Any) -> Decision:
        """The choice :meth:`run` would make for these very inputs, with reasons."""
        return self.explain_prepared(self._as_call(args, kwargs))

    def explain_prepared(self, call: OpCall, precision: str | None = None) -> Decision:
        """:meth:`explain_call` for a prepared call (``precision``: as :meth:`run`)."""
        return dispatch.explain(self, call, precision)
