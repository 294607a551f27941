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

:func:`fake_torch_npu_prologue` adds ``npu_rms_norm`` and ``npu_rotary_mul``, written from
their documented contracts (the sources are cited in :mod:`ditops.kernels.npu.qk_norm_rope`):
they refuse what the documentation leaves out (:class:`DocumentedContractError`) and
compute as CANN's kernel and golden reference do (fp32 inside, one rounding of the output).
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

import torch

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


# --- torch_npu's attention-prologue kernels ---------------------------------------------------

_NPU_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


class DocumentedContractError(RuntimeError):
    """What a double raises for arguments outside the real function's documented contract."""


def npu_rms_norm(
    self: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch_npu.npu_rms_norm``: ``(x / sqrt(mean(x^2) + eps) * gamma, rstd)``.

    Contract (torch_npu API reference): ``self`` fp16/bf16/fp32 with 2-8 dims, ``gamma``
    in ``self``'s dtype and of its trailing shape, not empty. Computed as CANN's kernel
    does: fp32 inside, the sum of squares in its own order times ``1/n``, ``1 / sqrt``, the
    weight applied in fp32, one rounding to ``self``'s dtype; ``rstd`` fp32.
    """
    if self.dtype not in _NPU_FLOATS or gamma.dtype != self.dtype:
        raise DocumentedContractError(
            f"npu_rms_norm: self {self.dtype} and gamma {gamma.dtype}; documented: "
            "fp16/bf16/fp32, gamma in self's dtype"
        )
    if not 2 <= self.dim() <= 8 or gamma.numel() == 0:
        raise DocumentedContractError(f"npu_rms_norm: self of {self.dim()} dims, gamma empty?")
    dims = tuple(range(self.dim() - gamma.dim(), self.dim()))
    if tuple(gamma.shape) != tuple(self.shape[self.dim() - gamma.dim() :]):
        raise DocumentedContractError("npu_rms_norm: gamma must have self's trailing shape")
    x32 = self.float()
    # another summation order than torch's mean (the kernel reduces in halves)
    squares = x32.flip(dims) * x32.flip(dims)
    rstd = 1 / torch.sqrt(squares.sum(dims, keepdim=True) * (1.0 / gamma.numel()) + epsilon)
    return (x32 * rstd * gamma.float()).to(self.dtype), rstd


def npu_rotary_mul(
    input: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half"
) -> torch.Tensor:
    """``torch_npu.npu_rotary_mul``: ``r1 * input + r2 * rotate(input)``.

    Contract (torch_npu API reference, A2/A3, for a BSND ``input``): 4-D tensors of
    fp16/bf16/fp32 (r1/r2 in input's dtype, as aclnnRotaryPositionEmbedding asks);
    ``D < 896`` and even; ``'half'``: ``B, N < 1000``, r1/r2 ``[1 or B, S, 1, D]``;
    ``'interleave'``: ``B * N < 1000``, r1/r2 ``[1, S, 1, D]``; r1/r2 within ``[-1, 1]``.
    Computed in fp32, the output rounded once to input's dtype.
    """
    if input.dim() != 4 or r1.dim() != 4 or r2.shape != r1.shape:
        raise DocumentedContractError("npu_rotary_mul: input, r1, r2 must be 4-D, r1/r2 alike")
    if input.dtype not in _NPU_FLOATS or r1.dtype != input.dtype or r2.dtype != input.dtype:
        raise DocumentedContractError(
            f"npu_rotary_mul: input {input.dtype}, r1 {r1.dtype}, r2 {r2.dtype}; documented: "
            "fp16/bf16/fp32 in one dtype"
        )
    B, S, N, D = input.shape
    if D >= 896 or D % 2:
        raise DocumentedContractError(f"npu_rotary_mul: D = {D}; documented: D < 896, even")
    if rotary_mode == "half":
        ok = B < 1000 and N < 1000 and list(r1.shape) in ([1, S, 1, D], [B, S, 1, D])
    elif rotary_mode == "interleave":
        ok = B * N < 1000 and list(r1.shape) == [1, S, 1, D]
    else:
        raise DocumentedContractError(f"npu_rotary_mul: rotary_mode {rotary_mode!r}")
    if not ok:
        raise DocumentedContractError(
            f"npu_rotary_mul ({rotary_mode}): input {list(input.shape)} with tables "
            f"{list(r1.shape)} is outside the documented layouts"
        )
    if not bool((r1.abs() <= 1).all() and (r2.abs() <= 1).all()):
        raise DocumentedContractError("npu_rotary_mul: r1/r2 outside the documented [-1, 1]")
    x = input.float()
    if rotary_mode == "half":
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat([-x2, x1], dim=-1)
    else:
        rotated = torch.stack([-x[..., 1::2], x[..., 0::2]], dim=-1).flatten(-2)
    return (r1.float() * x + r2.float() * rotated).to(input.dtype)


#: The prologue functions, by name.
PROLOGUE_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "npu_rms_norm": npu_rms_norm,
    "npu_rotary_mul": npu_rotary_mul,
}


@contextlib.contextmanager
def fake_torch_npu_prologue(
    replace: Mapping[str, Callable[..., Any] | None] | None = None,
) -> Iterator[list[str]]:
    """torch_npu with :data:`PROLOGUE_FUNCTIONS` for the block; ``replace`` swaps one
    (None: the release lacks it). Yields the names of the functions called, in order."""
    calls: list[str] = []
    functions = {**PROLOGUE_FUNCTIONS, **(replace or {})}

    def recorded(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return fn(*args, **kwargs)

        return call

    present = {name: recorded(name, fn) for name, fn in functions.items() if fn is not None}
    with fake_torch_npu(present):
        yield calls
