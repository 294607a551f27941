"""A fast path's declaration, and the reports explanations are made of.

A path is a method of an op decorated with :func:`path`. The declaration says which
device kinds it serves (one Triton path serves ``cuda``, ``hip`` and ``xpu``), the
optional library it needs, the precisions it honours, the dtypes it takes, whether it
has a backward, whether it propagates NaN/inf as the meaning does, and its own reasons
for refusing a call, next to it, the way xformers' operators declare theirs. The
dispatcher (:mod:`ditops.core.op`) and ``ditops info`` read the same declarations.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from ditops.backends.base import Backend
from ditops.core.checks import FLOATS, PRECISIONS, dtype_names
from ditops.platform import DEVICE_KINDS

NATIVE = "forward_native"

#: ``reasons(call) -> list[str]``: why a path cannot take this call, in words.
Reasons = Callable[[Any], list[str]]
F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class PathSpec:
    """What one path serves, needs, promises and accepts (made by :func:`path`)."""

    name: str
    kinds: tuple[str, ...]
    fn: Callable[..., Any]
    backend: Backend | None = None
    precisions: frozenset[str] = frozenset({"fast"})
    dtypes: frozenset[torch.dtype] | None = None
    inference_only: bool = False
    propagates_non_finite: bool = False
    reasons: Reasons | None = None
    #: In ``fast`` precision, what this path's bits equal (:func:`path`'s ``fast_bits``).
    fast_bits: str | None = None

    def accepts(self) -> str:
        """What this path takes, in words (for explanations)."""
        parts = [f"precision {'/'.join(sorted(self.precisions))}"]
        if self.dtypes is not None:
            parts.append(f"dtypes {dtype_names(self.dtypes)}")
        if self.inference_only:
            parts.append("inference only (no autograd)")
        if self.reasons is not None:
            doc = (self.reasons.__doc__ or "").strip().split("\n\n")[0]
            parts.append("per call: " + (" ".join(doc.split()) or self.reasons.__name__))
        if self.backend is not None:
            parts.append(f"needs {self.backend.name}")
        return ", ".join(parts)

    @property
    def per_call(self) -> bool:
        """Whether it refuses some calls the plan cannot foresee (its own reasons, or
        dtypes narrower than every float): then the next path may serve them."""
        return self.reasons is not None or (
            self.dtypes is not None and self.dtypes != frozenset(FLOATS)
        )


def path(
    *kinds: str,
    backend: Backend | None = None,
    precisions: Iterable[str] = ("fast",),
    dtypes: Iterable[torch.dtype] | None = None,
    inference_only: bool = False,
    propagates_non_finite: bool = False,
    reasons: Reasons | None = None,
    fast_bits: str | None = None,
) -> Callable[[F], F]:
    """Declare a method as a fast path of its op.

    Args:
        kinds: the device kinds it serves; none given: the one its name says
            (``forward_cpu`` serves ``cpu``).
        backend: the optional library it calls; probed lazily, on first use.
        precisions: which of ``"fast"``/``"exact"`` it honours; the one in force is the
            call record's ``exact``.
        dtypes: dtypes the call's floating tensors may have (``None``: any).
        inference_only: no autograd: skipped when a gradient is needed.
        propagates_non_finite: tested to give NaN/inf where the meaning does, so the
            op's non-finite rule is not applied to it.
        reasons: ``reasons(call) -> list[str]``: the calls it refuses, in words.
        fast_bits: what its output equals bit for bit in ``fast`` precision, for the
            tuner (which chooses only among paths giving the same bits,
            :mod:`ditops.core.same_bits`): ``"native"`` when it gives the meaning's bits
            there too, a name it shares with the paths whose bits it gives; ``None``
            (the default): its own bits. In ``exact`` every path gives the meaning's.

    The method takes the op's call record (``forward_x(self, call)``; ops without a
    record type take the call's arguments). Called directly with plain arguments it
    prepares them first, so a test can run one path on its own.
    """
    precs = frozenset(precisions)
    if not precs or precs - set(PRECISIONS):
        raise ValueError(f"path precisions must be a non-empty subset of {PRECISIONS}")
    for kind in kinds:
        if kind not in DEVICE_KINDS:
            raise ValueError(f"path: unknown device kind {kind!r}; known: {DEVICE_KINDS}")

    def decorate(fn: F) -> F:
        served = kinds or (fn.__name__.removeprefix("forward_"),)
        if served[0] not in DEVICE_KINDS:
            raise ValueError(
                f"path {fn.__name__}: name the device kinds it serves, e.g. @path('cuda', 'hip')"
            )
        spec = PathSpec(
            name=fn.__name__,
            kinds=tuple(served),
            fn=fn,
            backend=backend,
            precisions=precs,
            dtypes=None if dtypes is None else frozenset(dtypes),
            inference_only=inference_only,
            propagates_non_finite=propagates_non_finite,
            reasons=reasons,
            fast_bits=fast_bits,
        )

        @functools.wraps(fn)
        def direct(self: Any, *args: Any, **kwargs: Any) -> Any:
            return self.run_path(spec, args, kwargs)

        direct._ditops_path = spec  # type: ignore[attr-defined]
        return direct  # type: ignore[return-value]

    return decorate


def runner(cls: type, spec: PathSpec, unpack: bool) -> Callable[[Any, Any], Any]:
    """How the dispatcher runs ``spec`` for op class ``cls`` on a call: the path's function
    (``unpack``: given the arguments, for ops without a record type), or, where the class
    attribute was replaced since (a test's spy wrapping the path), that attribute."""
    attr = getattr(cls, spec.name, None)
    if attr is None or getattr(attr, "__wrapped__", None) is spec.fn:
        if unpack:
            return lambda op, call: spec.fn(op, *call.args, **call.kwargs)
        return spec.fn
    return lambda op, call: attr(op, call)


@dataclass
class PathReport:
    """Why one path was or was not chosen."""

    path: str
    reasons: list[str] = field(default_factory=list)
    accepts: str = ""
    per_call: bool = False  # refuses some calls by their arguments (PathSpec.per_call)

    @property
    def usable(self) -> bool:
        return not self.reasons


@dataclass
class Decision:
    """The choice for one (op, device kind, precision): every path declared for the kind,
    in the order tried, with its reasons; ``chosen`` is the first without any."""

    op: str
    device_kind: str
    precision: str
    chosen: str
    candidates: list[PathReport]
    #: Set when a measured choice (DITOPS_TUNE) picked ``chosen`` for this call's shape
    #: class: the times that chose it; or when the call is small enough for the meaning
    #: (:data:`ditops.core.plan.SMALL_CALL_ELEMENTS`): why.
    tuned: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "device_kind": self.device_kind,
            "precision": self.precision,
            "chosen": self.chosen,
            "candidates": [
                {
                    "path": c.path,
                    "usable": c.usable,
                    "reasons": c.reasons,
                    "accepts": c.accepts,
                    "per_call": c.per_call,
                }
                for c in self.candidates
            ],
            "tuned": self.tuned,
        }
