"""A test double of sgl-kernel-npu's legacy ``attentions`` package, for machines without an NPU.

The real package registers operators under ``torch.ops.attentions.*`` for the NPU device
only. This double registers the same schemas (``shared/docs/npu-attentions-ops.md``) in a
``torch.library`` fragment with CPU kernels written from the documented semantics, and
puts a module named ``attentions`` in ``sys.modules`` so that ``import attentions``
succeeds. The kernels also check the documented argument contract (dtypes, impl_mode),
so a call that the real operator would reject fails here too, and every call is recorded
for tests to inspect. :func:`register_fake_ops` is shared with the double of the current
package (:mod:`tests.doubles.npu_sgl_kernel`), which registers the same kernels under
``torch.ops.npu``.

Use with ``ditops.force_device_kind({"cpu": "npu"})`` so CPU tensors take ``forward_npu``.
It also models the ways the real package can be unusable: not installed
(:func:`no_attentions`), installed without an op (``ops=`` leaves it out) and an op that
raises at call time (``raising=``).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from tests.doubles.npu_modules import swapped_modules

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class Recorder:
    """Every call made to a fake op: (op name, args)."""

    calls: list[tuple[str, tuple[Any, ...]]] = field(default_factory=list)

    def of(self, name: str) -> list[tuple[Any, ...]]:
        return [args for op, args in self.calls if op == name]


# name -> (schema after the name, CPU implementation taking (*args))
FAKE_OPS: dict[str, tuple[str, Callable[..., Any]]] = {}


def fake_op(name: str, schema: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Add a fake kernel for ``torch.ops.attentions.<name>`` with the real op's schema."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        FAKE_OPS[name] = (schema, fn)
        return fn

    return decorate


class FakeKernelError(RuntimeError):
    """What a fake op configured to fail raises at call time."""


@fake_op(
    "layernorm",
    "(Tensor input, int[] normalized_shape, Tensor? weight=None, Tensor? bias=None, "
    "float eps=1e-05, int impl_mode=0) -> (Tensor, Tensor, Tensor)",
)
def _layernorm(
    x: torch.Tensor,
    normalized_shape: list[int],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    impl_mode: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # The contract of aclnnLayerNormWithImplMode, as documented.
    if x.dtype not in _FLOATS:
        raise RuntimeError(f"attentions.layernorm: input dtype {x.dtype} not supported")
    for p in (weight, bias):
        if p is not None and p.dtype not in (x.dtype, torch.float32):
            raise RuntimeError(
                f"attentions.layernorm: weight/bias dtype {p.dtype} must be {x.dtype} or fp32"
            )
    if weight is not None and bias is not None and weight.dtype != bias.dtype:
        raise RuntimeError("attentions.layernorm: weight and bias must have the same dtype")
    if impl_mode not in (0, 1, 2):
        raise RuntimeError(f"attentions.layernorm: impl_mode {impl_mode} rejected")
    if impl_mode == 2 and not all(t is None or t.dtype == torch.float16 for t in (x, weight, bias)):
        raise RuntimeError("attentions.layernorm: impl_mode 2 needs every input in fp16")
    w = None if weight is None else weight.float()
    b = None if bias is None else bias.float()
    out, mean, rstd = torch.native_layer_norm(x.float(), normalized_shape, w, b, eps)
    return out.to(x.dtype), mean, rstd


def register_fake_ops(
    namespace: str,
    names: Iterable[str],
    recorder: Recorder,
    raising: Iterable[str] = (),
    check: Callable[[str, tuple[Any, ...]], None] | None = None,
    extra_schemas: dict[str, str] | None = None,
) -> torch.library.Library:
    """Register fake kernels of :data:`FAKE_OPS` under ``torch.ops.<namespace>``.

    ``check(name, args)`` runs before each kernel (a package's own argument contract);
    ``extra_schemas`` defines more ops whose kernel raises. ``lib._destroy()`` removes
    them all again.
    """
    failing = set(raising)
    lib = torch.library.Library(namespace, "FRAGMENT")  # noqa: TOR901 - test double
    for name in names:
        schema, impl = FAKE_OPS[name]
        lib.define(name + schema)
        kernel = _recording(namespace, name, impl, recorder, name in failing, check)
        lib.impl(name, kernel, "CPU")
    for name, schema in (extra_schemas or {}).items():
        lib.define(name + schema)
        lib.impl(name, _recording(namespace, name, None, recorder, True, None), "CPU")
    return lib


@contextlib.contextmanager
def fake_attentions(
    ops: Iterable[str] | None = None,
    raising: Iterable[str] = (),
    extra_schemas: dict[str, str] | None = None,
) -> Iterator[Recorder]:
    """Install the fake ``attentions`` package for the block.

    Args:
        ops: which fake ops to register (default: all of :data:`FAKE_OPS`). Leaving an
            op out models a build of the package that lacks it.
        raising: ops whose kernel raises :class:`FakeKernelError` at call time.
        extra_schemas: more ops to define that ditops does not call (a build whose ops
            have other names), as name -> schema; their kernel raises.
    """
    names = list(FAKE_OPS) if ops is None else list(ops)
    recorder = Recorder()
    lib = register_fake_ops("attentions", names, recorder, raising, None, extra_schemas)
    module = types.ModuleType("attentions")
    module.__doc__ = "test double of sgl-kernel-npu's legacy attentions package"
    try:
        with swapped_modules({"attentions": module}):
            yield recorder
    finally:
        lib._destroy()


@contextlib.contextmanager
def no_attentions() -> Iterator[None]:
    """Make ``import attentions`` fail with ImportError for the block (not installed)."""
    with swapped_modules({"attentions": None}):
        yield


def _recording(
    namespace: str,
    name: str,
    impl: Callable[..., Any] | None,
    recorder: Recorder,
    fail: bool,
    check: Callable[[str, tuple[Any, ...]], None] | None,
) -> Callable[..., Any]:
    def kernel(*args: Any) -> Any:
        # The dispatcher drops trailing arguments equal to their schema defaults: put them
        # back, so kernels and recorded calls always see every argument.
        schema = getattr(getattr(torch.ops, namespace), name).default._schema
        args = args + tuple(a.default_value for a in schema.arguments[len(args) :])
        recorder.calls.append((name, args))
        if fail or impl is None:
            raise FakeKernelError(f"fake {namespace}.{name} failed at run time (test double)")
        if check is not None:
            check(name, args)
        return impl(*args)

    return kernel
