"""Which kind of device a tensor lives on, and what this process can see.

The dispatcher keys every choice on a *device kind*: ``cpu``, ``cuda``, ``hip``,
``npu``, ``xpu`` or ``mps`` (anything else is passed through as torch names it).
A ROCm build of torch reports its GPUs as device type ``cuda``; they are kind
``hip`` here because the fast paths for them differ. Ascend NPUs appear once
``torch_npu`` is imported, as device type ``npu`` (torch's ``privateuseone``).

Nothing here imports an optional package at module import time; ``torch_npu`` is
imported lazily, once, by :func:`npu_available`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ditops.tracing import trace_time_constant

logger = logging.getLogger("ditops")

#: The device kinds ops may define a ``forward_<kind>`` for.
DEVICE_KINDS: tuple[str, ...] = ("cpu", "cuda", "hip", "npu", "xpu", "mps")

# The calling thread's force_device_kind mapping (.mapping), never shared between threads.
_local = threading.local()


def _raw_kind(device_type: str) -> str:
    if device_type == "cuda" and getattr(torch.version, "hip", None):
        return "hip"
    if device_type in ("privateuseone", "npu"):
        return "npu"
    return device_type


def device_kind(obj: torch.Tensor | torch.device | str) -> str:
    """Return the device kind of a tensor or device (``"cpu"``, ``"cuda"``, ``"hip"``, ...).

    A mapping installed with :func:`force_device_kind` is applied on top (tests use it
    to dispatch CPU tensors as if they lived on another device).
    """
    if isinstance(obj, torch.Tensor):
        # Not ``obj.is_cpu`` (cheaper eagerly): dynamo keeps that read as a graph node,
        # where ``.device`` is a constant (tests/integrations/test_compile_graph.py).
        dev_type = obj.device.type
        if dev_type == "cpu":
            forced = getattr(_local, "mapping", None)
            return forced.get("cpu", "cpu") if forced else "cpu"
    elif isinstance(obj, torch.device):
        dev_type = obj.type
    elif isinstance(obj, str):
        dev_type = torch.device(obj).type
    else:
        raise TypeError(
            f"device_kind expects a tensor, torch.device or str, got {type(obj).__name__}"
        )
    kind = _raw_kind(dev_type)
    forced = getattr(_local, "mapping", None)
    if forced:
        return forced.get(kind, kind)
    return kind


@contextlib.contextmanager
def force_device_kind(mapping: Mapping[str, str]) -> Iterator[None]:
    """Dispatch tensors of one device kind as if they were another, inside the block.

    ``force_device_kind({"cpu": "npu"})`` makes CPU tensors take the NPU paths: the
    way tests run ``forward_npu`` against a test double of the NPU operators, and
    ``forward_cuda`` under ``TRITON_INTERPRET=1``. Never active unless asked for.
    The mapping holds for the calling thread only, like :func:`ditops.override`; blocks
    nest, and the previous mapping is restored on exit.
    """
    for src, dst in mapping.items():
        if dst not in DEVICE_KINDS or src not in DEVICE_KINDS:
            raise ValueError(
                f"force_device_kind: unknown device kind in {src!r} -> {dst!r}; "
                f"known kinds are {', '.join(DEVICE_KINDS)}"
            )
    saved = getattr(_local, "mapping", None)
    _local.mapping = {**(saved or {}), **mapping}
    try:
        yield
    finally:
        _local.mapping = saved


def forced_device_kinds() -> dict[str, str]:
    """The calling thread's :func:`force_device_kind` mapping, if any (for explanations)."""
    return dict(getattr(_local, "mapping", None) or {})


@functools.lru_cache(maxsize=1)
def _import_torch_npu() -> tuple[bool, str]:
    """Try ``import torch_npu`` once. Returns (imported, reason if not)."""
    try:
        importlib.import_module("torch_npu")
    except ImportError as exc:
        return False, f"torch_npu is not installed ({exc.msg})"
    except (RuntimeError, OSError) as exc:  # a broken CANN install fails at import with these
        logger.warning("ditops: importing torch_npu failed: %s", exc)
        return False, f"torch_npu failed to import: {exc}"
    return True, ""


def npu_available() -> bool:
    """True when torch_npu imports and reports at least one usable NPU."""
    ok, _ = _import_torch_npu()
    npu = getattr(torch, "npu", None)
    return bool(ok and npu is not None and npu.is_available())


def _count(kind: str) -> int:
    if kind == "cpu":
        return 1
    if kind in ("cuda", "hip"):
        if not torch.cuda.is_available():
            return 0
        is_hip = bool(getattr(torch.version, "hip", None))
        return torch.cuda.device_count() if (kind == "hip") == is_hip else 0
    if kind == "xpu":
        xpu = getattr(torch, "xpu", None)
        return xpu.device_count() if xpu is not None and xpu.is_available() else 0
    if kind == "mps":
        mps = getattr(torch.backends, "mps", None)
        return 1 if mps is not None and mps.is_available() else 0
    if kind == "npu":
        return torch.npu.device_count() if npu_available() else 0  # type: ignore[attr-defined]
    return 0


def visible_devices() -> dict[str, int]:
    """How many devices of each kind this process can use (``cpu`` is always 1)."""
    return {kind: _count(kind) for kind in DEVICE_KINDS}


@trace_time_constant  # torch.compile: a constant in the graph (dynamo cannot trace the call)
def cpu_half_matmuls_slow() -> str | None:
    """torch's CPU capability (e.g. ``"AVX2"``) when its bf16/fp16 matmuls on this CPU take a
    fallback several times slower than fp32 (no AVX-512), else ``None``."""
    capability = torch.backends.cpu.get_cpu_capability()
    return None if capability.startswith("AVX512") else capability


@functools.cache
def cpuinfo(field: str) -> str:
    """The value of the first ``field`` line of /proc/cpuinfo (``"flags"``, ``"model name"``),
    or ``""`` where there is no such line or file (not Linux, a sandbox)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_flags() -> frozenset[str]:
    """Every flag /proc/cpuinfo lists for this CPU (empty where it cannot be read)."""
    return frozenset(cpuinfo("flags").split())


def platform_summary() -> dict[str, Any]:
    """Versions and devices, for ``ditops info``."""
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "hip_runtime": getattr(torch.version, "hip", None),
        "visible_devices": visible_devices(),
    }
    if torch.cuda.is_available():
        info["cuda_devices"] = [
            torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())
        ]
    forced = forced_device_kinds()
    if forced:
        info["forced_device_kinds"] = forced
    return info
