"""Shared set-up of the sglang tests: sglang's platform swapped in-process, as sglang's own
unit tests do (``platforms._current_platform``), ditops' plugin hooks applied in-process
as sglang's plugin loader applies them (once; each hook reads ``DITOPS_SGLANG`` when it
runs, so a block without the switch is stock), and sglang's native expression."""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator

import torch
from sglang.multimodal_gen.runtime import platforms
from sglang.multimodal_gen.runtime.layers import layernorm as ln

from ditops.integrations.sglang import plugin

#: sglang's built-in platform classes by kind (instantiable on any host).
BUILTIN = {
    "cpu": ("sglang.multimodal_gen.runtime.platforms.cpu", "CpuPlatform"),
    "cuda": ("sglang.multimodal_gen.runtime.platforms.cuda", "CudaPlatform"),
    "npu": ("sglang.multimodal_gen.runtime.platforms.npu", "NPUPlatformBase"),
}
_installed: list[bool] = []


def install_hooks() -> None:
    """ditops' hooks registered and applied with sglang's registry (once per process)."""
    if not _installed:
        from sglang.multimodal_gen.runtime.platforms.plugins import HookRegistry

        plugin.register_hooks()
        HookRegistry.apply_hooks()
        _installed.append(True)


@contextlib.contextmanager
def switch(on: bool) -> Iterator[None]:
    saved = os.environ.get("DITOPS_SGLANG")
    os.environ["DITOPS_SGLANG"] = "1" if on else "0"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["DITOPS_SGLANG"]
        else:
            os.environ["DITOPS_SGLANG"] = saved


def builtin_platform(kind: str) -> object:
    module, name = BUILTIN[kind]
    return getattr(importlib.import_module(module), name)()


@contextlib.contextmanager
def current_platform(instance: object) -> Iterator[object]:
    """``instance`` is sglang's current platform inside the block; modules built there
    bind their forwards from it (``CustomOp`` binds in ``__init__``)."""
    saved = platforms._current_platform
    platforms._current_platform = instance
    try:
        yield instance
    finally:
        platforms._current_platform = saved


@contextlib.contextmanager
def ditops_platform(kind: str = "cpu", instance: object | None = None) -> Iterator[object]:
    """sglang's built-in platform of ``kind`` (or ``instance``) with ditops' plugin on."""
    install_hooks()
    with switch(True), current_platform(instance or builtin_platform(kind)) as platform:
        yield platform


@contextlib.contextmanager
def stock_cpu_platform() -> Iterator[object]:
    """sglang's own CPU platform, ditops' switch off (its hooks, if applied, pass)."""
    with switch(False), current_platform(builtin_platform("cpu")) as platform:
        yield platform


@contextlib.contextmanager
def native_expression() -> Iterator[None]:
    """sglang's ``forward_native`` bodies run eagerly (their ``torch.compile`` off), with
    ``fuse_scale_shift_kernel`` read as sglang's own plain-torch fallback (its CPU build
    calls sgl_kernel, which no registry serves): the meaning the adapter promises."""
    import torch._dynamo
    from sglang.kernels.ops.diffusion.common.fallback_torch import fuse_scale_shift_kernel_native

    saved = ln.fuse_scale_shift_kernel
    ln.fuse_scale_shift_kernel = fuse_scale_shift_kernel_native
    try:
        with torch._dynamo.config.patch(disable=True):
            yield
    finally:
        ln.fuse_scale_shift_kernel = saved


def ulps(
    a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype | None = None
) -> float:
    """Largest ``|a - b|`` in ulps of ``dtype`` (default ``a``'s) at magnitude ``scale``."""
    eps = torch.finfo(dtype or a.dtype).eps
    unit = torch.exp2(torch.floor(torch.log2(scale.float().abs().clamp_min(1e-30)))) * eps
    return float(((a.float() - b.float()).abs() / unit).max())


def pair(factory):
    """The same module twice: with ditops' plugin on and under sglang's stock CPU
    platform, with the same random weights."""
    with ditops_platform():
        mine = factory()
    with stock_cpu_platform():
        ref = factory()
    torch.manual_seed(1)
    for p in mine.parameters():
        p.data.normal_()
    ref.load_state_dict(mine.state_dict())
    return mine, ref
