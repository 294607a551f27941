"""Public ops: the plain functions users call, one per op.

A public op is declared as a function with the op's parameters and a docstring that
states its meaning, shapes, dtypes and precision contract::

    @public_op(GeluTanhBiasOp())
    def gelu_tanh_bias(x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        \"\"\"The tanh GELU of ``x + bias`` ...\"\"\"

so ``help()``, ``inspect.signature``, IDEs and the API reference read its parameters. The
call runs the op module (``op(...)``: its hooks, then dispatch); the module itself is the
function's ``op`` attribute, for what belongs to it (``fn.op.explain_call(...)``,
``fn.op.forward_native(...)``, ``fn.op.register_forward_hook(...)``). The parameters are
checked against the op's ``prepare`` when the module is imported, so the two cannot drift,
and the docstring gets a generated "Paths" section from the op's declared paths.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from ditops.core.op import CustomOp
from ditops.core.paths import NATIVE

F = TypeVar("F", bound=Callable[..., Any])


def public_op(op: CustomOp) -> Callable[[F], F]:
    """Make the decorated function the public face of ``op`` (see the module docstring).

    Raises TypeError at decoration when the function's parameters (names, kinds,
    defaults) differ from ``op.prepare``'s, or when it has no docstring.
    """
    if not isinstance(op, CustomOp):
        raise TypeError(f"public_op takes a CustomOp instance, got {type(op).__name__}")

    def decorate(fn: F) -> F:
        _check_same_parameters(fn, op)
        if not (fn.__doc__ or "").strip():
            raise TypeError(f"public op {fn.__name__} needs a docstring stating its meaning")

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            return op(*args, **kwargs)

        call.__signature__ = _signature(fn)  # type: ignore[attr-defined]
        call.__doc__ = inspect.cleandoc(fn.__doc__ or "") + "\n\n" + paths_section(type(op))
        call.op = op  # type: ignore[attr-defined]
        return call  # type: ignore[return-value]

    return decorate


def paths_section(cls: type[CustomOp]) -> str:
    """The op's declared paths in words (generated: it cannot drift from the code)."""
    lines = ["Paths (declared; ``ditops info`` says which one runs on this machine):", ""]
    for spec in cls.declared_paths.values():  # what each takes, as ``ditops info`` says it
        lines.append(f"- {', '.join(spec.kinds)}: ``{spec.name}`` ({spec.accepts()})")
    lines.append(f"- any other call: ``{NATIVE}``, the meaning")
    return "\n".join(lines)


def _signature(fn: Callable[..., Any]) -> inspect.Signature:
    """The signature with its annotations evaluated where they can be (readable help())."""
    try:
        return inspect.signature(fn, eval_str=True)
    except (NameError, TypeError, SyntaxError):  # a name only known to type checkers
        return inspect.signature(fn)


def _check_same_parameters(fn: Callable[..., Any], op: CustomOp) -> None:
    def shape(sig: inspect.Signature) -> list[tuple[str, Any, Any]]:
        return [(p.name, p.kind, p.default) for p in sig.parameters.values()]

    public = shape(inspect.signature(fn))
    prepared = shape(inspect.signature(op.prepare))  # bound: no self
    if public != prepared:
        raise TypeError(
            f"public op {fn.__name__}{inspect.signature(fn)} does not take the parameters of "
            f"{type(op).__name__}.prepare{inspect.signature(op.prepare)}; make them the same"
        )
