"""Installing and removing the NPU Python packages (or test doubles of them) within a test.

The NPU fast paths import ``sgl_kernel_npu`` (current sgl-kernel-npu), ``attentions``
(its legacy layout) and ``torch_npu``. Tests decide which of them "exist" by putting
modules, or ``None`` (then ``import`` raises ImportError: not installed), in
``sys.modules`` for a block, and restore every entry after it. Backend probes are
forgotten on entry and exit (``ditops.custom_op.reset_state``), so each block is probed
afresh.

:func:`fake_torch_npu` is a double of ``torch_npu`` only in what ditops asks of it: that it
imports, and (for :func:`ditops.backends.npu.torch_npu_op`) that it has named functions.
On CPU tensors dispatched as NPU tensors, ``F.layer_norm`` runs ATen's CPU kernel, with
the semantics torch_npu documents for its own (the mixed-dtype contract of aclnnLayerNorm).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import ditops.custom_op

#: Every module name ditops' NPU backends import.
NPU_MODULES = ("sgl_kernel_npu", "sgl_kernel_npu.attentions", "attentions", "torch_npu")


@contextlib.contextmanager
def swapped_modules(modules: Mapping[str, types.ModuleType | None]) -> Iterator[None]:
    """``sys.modules[name] = module`` for the block (None: importing it raises ImportError)."""
    saved = {name: sys.modules.get(name, _ABSENT) for name in modules}
    sys.modules.update(modules)  # type: ignore[arg-type]
    ditops.custom_op.reset_state()
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is _ABSENT:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module  # type: ignore[assignment]
        ditops.custom_op.reset_state()


_ABSENT = object()


@contextlib.contextmanager
def hidden_npu_packages() -> Iterator[None]:
    """None of the NPU packages is installed, whatever this machine has (tests start here
    and install the doubles they need)."""
    with swapped_modules(dict.fromkeys(NPU_MODULES)):
        yield


def fake_torch_npu_module(functions: Mapping[str, Callable[..., Any]] | None = None) -> Any:
    """A module named ``torch_npu`` with ``functions`` as attributes."""
    module = types.ModuleType("torch_npu")
    module.__doc__ = "test double of torch_npu (importable, with the given functions)"
    module.__version__ = "2.13.0.test-double"  # type: ignore[attr-defined]
    for name, fn in (functions or {}).items():
        setattr(module, name, fn)
    return module


@contextlib.contextmanager
def fake_torch_npu(functions: Mapping[str, Callable[..., Any]] | None = None) -> Iterator[Any]:
    """``import torch_npu`` succeeds for the block; yields the module."""
    module = fake_torch_npu_module(functions)
    with swapped_modules({"torch_npu": module}):
        yield module


class _FailingImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``name`` and fails to execute it, as a package whose own import raises."""

    def __init__(self, name: str, error: Exception) -> None:
        self.name = name
        self.error = error

    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        raise self.error


@contextlib.contextmanager
def failing_import(name: str, error: Exception) -> Iterator[None]:
    """``import name`` finds the package and raises ``error`` while importing it (e.g.
    ``ModuleNotFoundError(name="torch_npu")``: installed, but its dependency is not)."""
    finder = _FailingImport(name, error)
    saved = sys.modules.pop(name, _ABSENT)
    sys.meta_path.insert(0, finder)
    ditops.custom_op.reset_state()
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        sys.modules.pop(name, None)
        if saved is not _ABSENT:
            sys.modules[name] = saved  # type: ignore[assignment]
        ditops.custom_op.reset_state()
