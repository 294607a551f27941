"""The Ascend NPU stack: operators the ``attentions`` package registers.

The ``attentions`` package (sgl-project/sgl-kernel-npu) registers its operators under
``torch.ops.attentions.*`` when imported; their contract is in
``shared/docs/npu-attentions-ops.md``. Three ways it can be unusable, each reported in
plain words: not installed, installed but without the operator ditops calls (a build
with other op names), and (found at call time by the dispatcher) an operator that
raises.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any

import torch

from ditops.backends.base import Backend

logger = logging.getLogger("ditops")

INSTALL_HINT = (
    "install torch_npu for your CANN version and the 'attentions' package built from "
    "github.com/sgl-project/sgl-kernel-npu"
)

_ops_cache: dict[tuple[str, ...], Backend] = {}


class AttentionsOp(Backend):
    """One operator of the ``attentions`` package, under its current name or older ones."""

    install_hint = INSTALL_HINT

    def __init__(self, names: tuple[str, ...]) -> None:
        super().__init__()
        self.names = names
        self.name = f"attentions.{names[0]}"

    def _probe(self) -> list[str]:
        try:
            importlib.import_module("attentions")
        except ImportError as exc:
            return [f"the 'attentions' package is not installed ({exc.msg}); {INSTALL_HINT}"]
        except (RuntimeError, OSError) as exc:
            return [f"the 'attentions' package failed to import ({exc}); {INSTALL_HINT}"]
        if self._resolve() is None:
            wanted = " or ".join(f"torch.ops.attentions.{n}" for n in self.names)
            return [
                f"the installed 'attentions' package registers no {wanted} (a build with other "
                f"op names); install a build of sgl-kernel-npu that provides {self.names[0]}"
            ]
        return []

    def _resolve(self) -> Callable[..., Any] | None:
        namespace = getattr(torch.ops, "attentions", None)
        if namespace is None:
            return None
        for name in self.names:
            # torch.ops namespaces raise AttributeError for an unknown op.
            try:
                return getattr(namespace, name)
            except AttributeError:
                continue
        return None

    def op(self) -> Callable[..., Any]:
        """The operator to call; only valid after a successful probe."""
        fn = self._resolve()
        if fn is None:
            raise RuntimeError(f"{self.name} is not available: {'; '.join(self.probe())}")
        return fn


def attentions_op(name: str, *older_names: str) -> AttentionsOp:
    """The backend for ``torch.ops.attentions.<name>`` (or an older name of the same op).

    One object per name set, so its probe result is shared by every op that uses it.
    """
    key = (name, *older_names)
    backend = _ops_cache.get(key)
    if backend is None:
        backend = _ops_cache.setdefault(key, AttentionsOp(key))
    return backend  # type: ignore[return-value]
