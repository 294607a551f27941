"""ditops' out-of-tree platform for sglang's diffusion runtime.

sglang asks each entry point of group ``sglang.multimodal_gen.platforms`` for a class
name; :func:`platform_qualname` answers with one of ``DitopsCpuPlatform``,
``DitopsCudaPlatform`` or ``DitopsNpuPlatform``: the host's built-in platform class
(found by sglang's own detectors, in sglang's order) with :class:`DitopsPlatformMixin`
in front. The classes are made on first access (module ``__getattr__``): importing
sglang's CUDA or NPU platform module on a host without that hardware is not needed.

What the mixin changes, and why:

* ``_enum = OOT`` (sglang requires it of an external platform), so the predicates the
  runtime branches on (``is_cpu``, ``is_cuda``, ``is_npu``, ``is_cuda_alike``), the
  torch device, the distributed backend and the torch.library key are answered as the
  built-in platform answers them: sglang's modules import kernels by them (on a CPU host
  ``is_cpu()`` must stay True, or ``layernorm.py`` imports Triton configs at import).
* ``get_dispatch_key_name()`` is the host's kind (``cpu``/``cuda``/``npu``): ``CustomOp``
  takes a forward registered under it, else the op's own ``forward_<kind>``, so every op
  ditops does not serve runs the built-in path.
* ``init_backend()`` (run once per worker before models are built) registers ditops'
  norm forwards (:func:`ditops.integrations.sglang.norms.register`).
* ``get_attn_backend_cls_str()`` resolves ``block_sparse_attn`` to ditops' backend
  (:mod:`ditops.integrations.sglang.attention`), every other choice as the built-in does.
* ``apply_server_args_defaults()`` checks ``--attention-backend-config`` for
  ``block_sparse_attn`` when sglang builds its arguments (before any worker starts).
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

import torch
from sglang.multimodal_gen.runtime.platforms import (
    AttentionBackendEnum,
    PlatformEnum,
    builtin_platform_plugins,
)

#: The host kinds ditops serves -> (sglang's module, built-in class, ditops' class name).
KINDS: dict[str, tuple[str, str, str]] = {
    "cpu": ("sglang.multimodal_gen.runtime.platforms.cpu", "CpuPlatform", "DitopsCpuPlatform"),
    "cuda": ("sglang.multimodal_gen.runtime.platforms.cuda", "CudaPlatform", "DitopsCudaPlatform"),
    "npu": ("sglang.multimodal_gen.runtime.platforms.npu", "NPUPlatformBase", "DitopsNpuPlatform"),
}
BACKEND = "ditops.integrations.sglang.attention.DitopsBlockSparseBackend"


def host_kind() -> str:
    """The built-in platform sglang would pick on this host, by sglang's own detectors."""
    for name, detect in builtin_platform_plugins.items():
        if detect() is not None:
            return name
    raise RuntimeError("sglang found no built-in platform on this host")


def platform_qualname(kind: str | None = None) -> str:
    """ditops' platform class for ``kind`` (default: the host's); refuses other kinds."""
    kind = host_kind() if kind is None else kind
    if kind not in KINDS:
        raise RuntimeError(
            f"DITOPS_SGLANG=1: ditops' sglang platform serves {', '.join(KINDS)} hosts; this "
            f"host's sglang platform is {kind!r}. Unset DITOPS_SGLANG to run sglang's own."
        )
    return f"{__name__}.{KINDS[kind][2]}"


class DitopsPlatformMixin:
    """The built-in platform of ``kind``, as an out-of-tree platform with ditops' ops."""

    _enum = PlatformEnum.OOT
    kind: str = "cpu"

    def get_dispatch_key_name(self) -> str:
        return self.kind

    def is_cpu(self) -> bool:
        return self.kind == "cpu"

    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @classmethod
    def is_cuda_static(cls) -> bool:
        return cls.kind == "cuda"

    def is_cuda_alike(self) -> bool:
        return self.kind == "cuda"

    def is_npu(self) -> bool:
        return self.kind == "npu"

    def get_device(self, local_rank: int) -> torch.device:
        return torch.device("cpu") if self.kind == "cpu" else torch.device(self.kind, local_rank)

    def get_torch_distributed_backend_str(self) -> str:
        return {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}[self.kind]

    def supports_distributed_device_id(self) -> bool:
        return self.kind == "cuda"

    def get_torch_library_dispatch_key(self) -> str:
        return "PrivateUse1" if self.kind == "npu" else "CUDA"

    def get_compile_backend(self, mode: str | None = None) -> str:
        if self.kind == "npu":  # what sglang's compile helper picks for its NPU platform
            from sglang.srt.utils.common import get_compiler_backend

            return get_compiler_backend()
        return super().get_compile_backend(mode)  # type: ignore[misc]

    def init_backend(self) -> None:
        super().init_backend()  # type: ignore[misc]
        from ditops.integrations.sglang.norms import SERVED, register

        register(self.get_dispatch_key_name())
        logging.getLogger(__name__).warning(
            "ditops platform (%s): ditops runs %s and block_sparse_attn; every other op runs "
            "sglang's own %s forward",
            self.kind, ", ".join(SERVED), self.kind,
        )  # fmt: skip

    def apply_server_args_defaults(self, server_args: Any) -> None:
        super().apply_server_args_defaults(server_args)  # type: ignore[misc]
        if (getattr(server_args, "attention_backend", None) or "").lower() == "block_sparse_attn":
            from ditops.integrations.sglang.attention import check_server_config

            check_server_config(server_args.attention_backend_config, self.kind)

    def get_attn_backend_cls_str(
        self, selected_backend: AttentionBackendEnum | None, head_size: int, dtype: torch.dtype
    ) -> str:
        if selected_backend == AttentionBackendEnum.BLOCK_SPARSE_ATTN:
            return BACKEND
        return super().get_attn_backend_cls_str(selected_backend, head_size, dtype)  # type: ignore[misc]


def builtin_class(kind: str) -> type:
    """sglang's built-in platform class for ``kind`` (one of :data:`KINDS`)."""
    module, base_name, _ = KINDS[kind]
    return getattr(importlib.import_module(module), base_name)


def _make(kind: str) -> type:
    _, base_name, name = KINDS[kind]
    base = builtin_class(kind)
    doc = f"sglang's {base_name} with ditops' ops (see :mod:`{__name__}`)."
    namespace = {"kind": kind, "__module__": __name__, "__qualname__": name, "__doc__": doc}
    return type(name, (DitopsPlatformMixin, base), namespace)


def __getattr__(name: str) -> Any:
    for kind, (_, _, class_name) in KINDS.items():
        if name == class_name:
            cls = globals()[name] = _make(kind)
            return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
