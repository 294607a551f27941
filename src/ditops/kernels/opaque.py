"""Kernels that torch.compile must treat as one opaque call, without eager overhead.

A kernel dynamo cannot trace (a loop over row blocks, a Triton launch) is registered as a
``torch.library`` custom op with a fake implementation, so a compiled graph calls it as
one node. Going through the custom-op machinery costs tens of microseconds per eager call
(``benchmarks/cpu/probes/dispatch_overhead.py`` times the dispatch around a kernel), which
on a GPU can be more than the kernel itself at 8k tokens. :func:`opaque_op` therefore
registers the op and returns a function that calls the op only while compiling and the
plain Python implementation otherwise; the two compute the same thing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ditops.backends.inductor_cpu import warn_if_known_to_fail
from ditops.tracing import traced


def opaque_op(name: str) -> Callable[[Callable[..., Any]], Any]:
    """Decorator: register ``fn`` as custom op ``name`` (no mutated args).

    The returned callable has the op's ``register_fake`` (use it as with a custom op) and
    the op itself as ``.op`` (``torch.ops.<namespace>.<name>`` works too).
    """

    def decorate(fn: Callable[..., Any]) -> Any:
        op = torch.library.custom_op(name, mutates_args=())(fn)

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if traced():
                first = next((a for a in args if isinstance(a, torch.Tensor)), None)
                if first is not None:
                    warn_if_known_to_fail(first.device.type, first.dtype == torch.bfloat16)
                return op(*args, **kwargs)
            return fn(*args, **kwargs)

        call.op = op  # type: ignore[attr-defined]
        call.register_fake = op.register_fake  # type: ignore[attr-defined]
        return call

    return decorate
