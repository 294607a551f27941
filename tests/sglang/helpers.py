"""Shared set-up of the sglang tests: sglang's platform swapped in-process, as sglang's own
unit tests do (``platforms._current_platform``), and sglang's native expression."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from sglang.multimodal_gen.runtime import platforms
from sglang.multimodal_gen.runtime.layers import layernorm as ln

from ditops.integrations.sglang import platform as plugin


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
def ditops_platform(kind: str = "cpu") -> Iterator[object]:
    """ditops' platform for ``kind``, its backend initialised as sglang's workers do."""
    instance = getattr(plugin, plugin.KINDS[kind][2])()
    with current_platform(instance):
        instance.init_backend()
        yield instance


@contextlib.contextmanager
def stock_cpu_platform() -> Iterator[object]:
    from sglang.multimodal_gen.runtime.platforms.cpu import CpuPlatform

    with current_platform(CpuPlatform()):
        yield


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
