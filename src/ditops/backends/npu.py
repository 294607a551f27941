"""The Ascend NPU stack: torch_npu and sgl-kernel-npu's kernels, current and legacy.

sgl-kernel-npu (github.com/sgl-project/sgl-kernel-npu) has shipped the kernels ditops
calls in two package layouts, and both are in the field (the contract of each operator
is in ``docs/npu.md``, "The kernels' contract"):

* **current**: the ``sgl_kernel_npu`` wheel. ``import sgl_kernel_npu`` (which imports
  ``torch_npu``) loads ``libsgl_kernel_npu.so``, registering
  ``torch.ops.npu.{ada_block_sparse_attention, sparse_block_estimate}``;
  ``sgl_kernel_npu.attentions`` wraps them in Python functions with the legacy argument
  names, defaults and order. It has no layer norm. The kernels are built only for
  Ascend910B (A2) and Ascend910_93 (A3): on other SoCs the ops are absent from
  ``torch.ops.npu`` and the wrappers raise ``RuntimeError`` when called.
* **legacy**: the ``attentions`` package (the one sglang's diffusion runtime imports),
  registering ``torch.ops.attentions.{layernorm, sparse_block_estimate,
  ada_block_sparse_attention}``; builds before sgl-kernel-npu PR 571 call the last one
  ``block_sparse_attention``.

:func:`npu_kernel` gives the backend of one kernel, probed per op: the current package
first, then the legacy one. Its ``name`` says what it resolved (``ditops info`` prints
it under "takes"), and its probe reasons say, per package, why nothing was found.
:func:`torch_npu_op` is the backend "torch_npu is importable", optionally with named
``torch_npu`` functions (``torch_npu_op("npu_rms_norm")``). :data:`NPU_LAYER_NORM`
chooses how to run an fp32-inside layer norm on the NPU.

The per-call limits of the attention kernels are the NPU paths' reasons, next to them
(:mod:`ditops.ops.attention_npu`).
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ditops.backends.base import Backend

INSTALL_HINT = (
    "install the sgl_kernel_npu wheel built from github.com/sgl-project/sgl-kernel-npu "
    "(it needs torch_npu for your CANN version)"
)
TORCH_NPU_HINT = "install torch_npu for your CANN version (github.com/Ascend/pytorch)"


@dataclass(frozen=True)
class NpuPackage:
    """One layout of sgl-kernel-npu: what to import and where its ops register."""

    module: str  # imported to register the ops
    namespace: str  # the ops are torch.ops.<namespace>.<name>
    wrappers: str | None  # a module of Python wrappers of the ops, if the layout has one
    fp16_high_precision: bool  # has the fp16 high-precision specialization (inner_precise 0)
    label: str  # in words, for explanations


SGL_KERNEL_NPU = NpuPackage(
    "sgl_kernel_npu", "npu", "sgl_kernel_npu.attentions", False, "sgl_kernel_npu"
)
LEGACY_ATTENTIONS = NpuPackage(
    "attentions", "attentions", None, True, "the legacy 'attentions' package"
)
#: Probe order: the current layout first.
PACKAGES: tuple[NpuPackage, ...] = (SGL_KERNEL_NPU, LEGACY_ATTENTIONS)


@dataclass(frozen=True)
class NpuCall:
    """A resolved kernel: the package it came from, its op name and what to call."""

    package: NpuPackage
    op_name: str
    fn: Callable[..., Any]
    via: str  # what ``fn`` is, in words

    @property
    def qualified(self) -> str:
        return f"torch.ops.{self.package.namespace}.{self.op_name}"


def _import(module: str, label: str) -> tuple[Any, str, str]:
    """(module or None, why not as a sentence, why not in two or three words)."""
    try:
        return importlib.import_module(module), "", ""
    except ImportError as exc:
        if exc.name == module:
            return None, f"{label} is not installed ({exc.msg})", "not installed"
        # e.g. sgl_kernel_npu installed without torch_npu: name says which module is missing
        return None, f"{label} failed to import ({exc})", "failed to import"
    except (RuntimeError, OSError) as exc:  # a broken CANN or .so fails to load with these
        return None, f"{label} failed to import ({exc})", "failed to import"


def _torch_op(namespace: str, name: str) -> Callable[..., Any] | None:
    ns = getattr(torch.ops, namespace, None)
    if ns is None:
        return None
    try:  # torch.ops namespaces raise AttributeError for an unknown op
        return getattr(ns, name)
    except AttributeError:
        return None


class NpuKernel(Backend):
    """One sgl-kernel-npu kernel, looked for in the current package, then the legacy one."""

    install_hint = INSTALL_HINT

    def __init__(
        self, op: str, current: tuple[str, ...], legacy: tuple[str, ...], absent_note: str = ""
    ) -> None:
        super().__init__()
        self.op_name = op
        self.names = {SGL_KERNEL_NPU: current, LEGACY_ATTENTIONS: legacy}
        self.absent_note = absent_note
        self._call: NpuCall | None = None
        self._notes: list[str] = []

    @property
    def name(self) -> str:  # type: ignore[override]
        call = self._call
        if call is None:
            return f"sgl-kernel-npu {self.op_name}"
        passed = f" ({'; '.join(self._notes)})" if self._notes else ""
        return f"{call.package.module}: {call.via}{passed}"

    @property
    def call(self) -> NpuCall | None:
        """What the probe resolved (None before a successful probe)."""
        return self._call if not self.probe() else None

    @property
    def notes(self) -> list[str]:
        """Per package passed over, why, in a few words (after a probe)."""
        self.probe()
        return list(self._notes)

    def _probe(self) -> list[str]:
        reasons: list[str] = []
        notes: list[str] = []
        for package in PACKAGES:
            call, why, short = self._resolve(package)
            if call is not None:
                self._call, self._notes = call, notes
                return []
            reasons.append(why)
            notes.append(f"{package.module}: {short}")
        self._notes = notes
        if self.names[SGL_KERNEL_NPU]:
            reasons[-1] = f"{reasons[-1]}; {INSTALL_HINT}"
        return reasons

    def _resolve(self, package: NpuPackage) -> tuple[NpuCall | None, str, str]:
        names = self.names[package]
        if not names:
            note = f" ({self.absent_note})" if self.absent_note else ""
            return None, f"{package.label} has no {self.op_name} kernel{note}", "ships none"
        _, why, short = _import(package.module, package.label)
        if why:
            return None, why, short
        for name in names:
            fn = _torch_op(package.namespace, name)
            if fn is not None:
                return self._prefer_wrapper(package, name, fn), "", ""
        wanted = " or ".join(f"torch.ops.{package.namespace}.{n}" for n in names)
        if package is SGL_KERNEL_NPU:
            why = (
                f"sgl_kernel_npu is installed but registers no {wanted}: its attention "
                "kernels are built only for Ascend910B (A2) and Ascend910_93 (A3) SoCs"
            )
        else:
            why = f"{package.label} is installed but registers no {wanted} (other op names?)"
        return None, why, f"no {names[0]}"

    @staticmethod
    def _prefer_wrapper(package: NpuPackage, name: str, op: Callable[..., Any]) -> NpuCall:
        """The package's Python wrapper where it has one (its argument names are the
        documented ones), else the torch op."""
        qualified = f"torch.ops.{package.namespace}.{name}"
        if package.wrappers is not None:
            try:
                wrappers = importlib.import_module(package.wrappers)
            except ImportError:
                wrappers = None
            fn = getattr(wrappers, name, None)
            if callable(fn):
                return NpuCall(package, name, fn, f"{package.wrappers}.{name} -> {qualified}")
        return NpuCall(package, name, op, qualified)

    def resolved(self) -> NpuCall:
        """What the probe found; RuntimeError (with the reasons) when it found nothing."""
        call = self.call
        if call is None:
            raise RuntimeError(f"{self.name} is not available: {'; '.join(self.probe())}")
        return call

    def op(self) -> Callable[..., Any]:
        """What to call; RuntimeError (with the reasons) when the probe found nothing."""
        return self.resolved().fn

    def reset(self) -> None:
        with self._lock:
            self._reasons = None
            self._call = None
            self._notes = []


_kernels: dict[tuple[Any, ...], NpuKernel] = {}
_kernels_lock = threading.Lock()


def npu_kernel(
    op: str,
    *,
    current: Sequence[str] = (),
    legacy: Sequence[str] = (),
    absent_note: str = "",
) -> NpuKernel:
    """The backend of the sgl-kernel-npu kernel ``op``.

    Args:
        current: its names under ``torch.ops.npu`` in ``sgl_kernel_npu`` (empty: none).
        legacy: its names under ``torch.ops.attentions``, newest first (empty: none).
        absent_note: why a package without it lacks it (shown in the reasons).

    One object per argument set, so its probe is shared by every op that uses it.
    """
    key = (op, tuple(current), tuple(legacy), absent_note)
    with _kernels_lock:
        backend = _kernels.get(key)
        if backend is None:
            backend = _kernels[key] = NpuKernel(op, tuple(current), tuple(legacy), absent_note)
    return backend


# --- torch_npu -----------------------------------------------------------------------------


class TorchNpuOp(Backend):
    """``torch_npu`` is importable and has the named functions (none: just importable)."""

    install_hint = TORCH_NPU_HINT

    def __init__(self, functions: tuple[str, ...]) -> None:
        super().__init__()
        self.functions = functions
        self.name = "torch_npu" + (f" ({', '.join(functions)})" if functions else "")

    def _probe(self) -> list[str]:
        module, why, _ = _import("torch_npu", "torch_npu")
        if module is None:
            return [f"{why}; {TORCH_NPU_HINT}"]
        version = getattr(module, "__version__", "unknown version")
        return [
            f"the installed torch_npu ({version}) has no torch_npu.{f} (an older release?)"
            for f in self.functions
            if not callable(getattr(module, f, None))
        ]

    def function(self, name: str) -> Callable[..., Any]:
        """``torch_npu.<name>``; only valid after a successful probe and for a probed name."""
        if name not in self.functions:
            raise ValueError(f"{self.name} was not asked for torch_npu.{name}")
        reasons = self.probe()
        if reasons:
            raise RuntimeError(f"torch_npu.{name} is not available: {'; '.join(reasons)}")
        return getattr(importlib.import_module("torch_npu"), name)  # type: ignore[no-any-return]


_torch_npu_ops: dict[tuple[str, ...], TorchNpuOp] = {}


def torch_npu_op(*functions: str) -> TorchNpuOp:
    """The backend for ``torch_npu`` with these functions (e.g. ``"npu_rms_norm"``).

    ``torch_npu_op()`` means "torch_npu imports". One object per function set.
    """
    with _kernels_lock:
        backend = _torch_npu_ops.get(functions)
        if backend is None:
            backend = _torch_npu_ops[functions] = TorchNpuOp(functions)
    return backend


#: torch_npu is importable (torch ops on NPU tensors then run torch_npu's kernels).
TORCH_NPU = torch_npu_op()


# --- the layer norm --------------------------------------------------------------------------

# impl_mode 0 of attentions.layernorm (aclnnLayerNormWithImplMode): high precision.
_HIGH_PRECISION = 0


class NpuLayerNorm(Backend):
    """An fp32-inside layer norm of a low-precision NPU tensor, the best way available.

    1. The legacy package's ``attentions.layernorm`` (aclnnLayerNormWithImplMode,
       impl_mode 0 = high precision), with fp32 weight and bias.
    2. Otherwise ``F.layer_norm`` of the NPU tensor with fp32 weight and bias, which
       torch_npu runs natively (aclnnLayerNorm, whose contract takes fp32 weight and
       bias with bf16/fp16 input and computes in fp32): ATen's mixed-dtype semantics,
       the same the CPU fast path uses. The current sgl_kernel_npu has no layer norm.

    Both read the input once and round the output once, so they keep the op's ``fast``
    contract (at most 1 ulp of the output dtype from ``forward_native``).
    """

    install_hint = f"{TORCH_NPU_HINT}; or {INSTALL_HINT}"

    def __init__(self) -> None:
        super().__init__()
        self.kernel = npu_kernel(
            "layernorm",
            legacy=("layernorm",),
            absent_note="the current sgl-kernel-npu no longer ships a layer norm",
        )
        self._use_kernel: bool | None = None

    @property
    def name(self) -> str:  # type: ignore[override]
        if self._use_kernel is None:
            return "npu layer norm"
        call = self.kernel.call
        if self._use_kernel and call is not None:
            return f"{call.package.module}: {call.via}, impl_mode 0 (high precision)"
        return (
            "torch_npu: F.layer_norm with fp32 weight and bias (ATen mixed dtype; no "
            f"layernorm kernel: {'; '.join(self.kernel.notes)})"
        )

    def _probe(self) -> list[str]:
        kernel = self.kernel.probe()
        if not kernel:
            self._use_kernel = True
            return []
        torch_npu = TORCH_NPU.probe()
        if not torch_npu:
            self._use_kernel = False
            return []
        return [*kernel, *torch_npu]

    def layer_norm(
        self,
        x: torch.Tensor,
        normalized_shape: Sequence[int],
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        eps: float,
    ) -> torch.Tensor:
        """``x`` normalised over ``normalized_shape`` in fp32, returned in x's dtype.

        ``weight``/``bias``: fp32 or None. Only valid after a successful probe.
        """
        if self.probe():
            raise RuntimeError(f"no NPU layer norm is available: {'; '.join(self.probe())}")
        if self._use_kernel:
            shape = list(normalized_shape)
            out: torch.Tensor = self.kernel.op()(x, shape, weight, bias, eps, _HIGH_PRECISION)[0]
            return out
        return F.layer_norm(x, tuple(normalized_shape), weight, bias, eps)

    def reset(self) -> None:
        with self._lock:
            self._reasons = None
            self._use_kernel = None


#: The layer norm of FP32LayerNorm and the modulation ops on the NPU.
NPU_LAYER_NORM = NpuLayerNorm()
