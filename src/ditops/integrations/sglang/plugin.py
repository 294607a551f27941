"""ditops in sglang as a general plugin: hooks through sglang's own ``HookRegistry``.

sglang runs every entry point of group ``sglang.multimodal_gen.plugins`` in each of its
processes (launcher, scheduler workers, HTTP server) after the platform is chosen, then
applies the hooks they registered. ditops takes no platform slot: whichever platform
sglang picked (built in, or a vendor's out-of-tree one) stays the platform, and these
hooks put ditops' ops under it:

* ``CustomOp.dispatch_forward`` (around): a module of a class ditops serves binds
  ditops' forward (:data:`FORWARDS`); every other module binds what the platform gives.
  sglang binds forwards in ``CustomOp.__init__``, so this holds for every model built
  after the hooks apply (sglang applies them before it builds any).
* ``selector._cached_get_attn_backend`` (around): ``block_sparse_attn`` resolves to
  ditops' backend on every platform, for the DiTs; text and image encoders (sglang
  builds them under the global backend too) get the platform's dense default, with no
  warning; every other choice as the platform answers it.
* ``ServerArgs.__post_init__`` (after): ``--attention-backend-config`` in every form
  sglang takes (JSON, ``k=v``, a ``.json``/``.yaml`` file; sglang has parsed it by then)
  is checked when the arguments are built, before any worker starts (and a causal
  pipeline, which builds no block-sparse metadata, is refused); the start-up
  notice says which ops ditops serves and where the platform's device has no ditops
  kernel for the backend.
* ``ComponentLoader._load_native_with_context`` (around): sglang's loader answers a
  failed model build by loading diffusers' class instead; when the failure is ditops'
  the fallback is refused and ditops' error stops the worker (and so the server).

Each hook asks :func:`ditops.config.sglang_enabled` when it runs: ``DITOPS_SGLANG`` unset
in a process leaves that process stock even if the hooks are in place.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from functools import partial
from typing import Any

log = logging.getLogger(__name__)

CUSTOM_OP = "sglang.multimodal_gen.runtime.layers.custom_op.CustomOp.dispatch_forward"
SELECTOR = "sglang.multimodal_gen.runtime.layers.attention.selector._cached_get_attn_backend"
SERVER_ARGS = "sglang.multimodal_gen.runtime.server_args.server_args.ServerArgs.__post_init__"
LOADER = (
    "sglang.multimodal_gen.runtime.loader.component_loaders.component_loader."
    "ComponentLoader._load_native_with_context"
)
BACKEND = "ditops.integrations.sglang.attention.DitopsBlockSparseBackend"
#: Device types ditops' block-sparse attention has kernels for (others run its meaning).
SPARSE_KERNEL_DEVICES = ("cpu", "cuda", "npu", "xpu")


_forced: list[bool] = []


def enabled() -> bool:
    """``DITOPS_SGLANG``, unless :func:`forced` says otherwise for this block."""
    if _forced:
        return _forced[-1]
    from ditops.config import sglang_enabled

    return sglang_enabled()


@contextlib.contextmanager
def forced(on: bool) -> Iterator[None]:
    """The hooks act as if the switch were ``on`` inside the block (the bench builds stock
    and ditops models side by side in one process)."""
    _forced.append(on)
    try:
        yield
    finally:
        _forced.pop()


def served() -> dict[type, Any]:
    """sglang's op class -> ditops' forward ``fn(module, *args)`` (imports sglang)."""
    from ditops.integrations.sglang.forwards import forwards

    return forwards()


#: The served classes this process has bound ditops' forward to (logged once each).
bound: set[str] = set()


def dispatch_forward(original: Any, module: Any) -> Any:
    if enabled():
        fn = served().get(type(module))
        if fn is not None:
            name = type(module).__name__
            if name not in bound:
                bound.add(name)
                log.info("ditops: sglang's %s runs ditops' forward (%s)", name, fn.__name__)
            return partial(fn, module)
    return original(module)


#: Components whose attention stays dense under ``block_sparse_attn`` (no latent video).
DENSE_COMPONENTS = ("text_encoder", "image_encoder")


def cached_get_attn_backend(original: Any, head_size, dtype, supported, selected) -> Any:
    from sglang.multimodal_gen.runtime.layers.attention.selector import (
        get_component_attn_backend_name,
    )
    from sglang.multimodal_gen.runtime.platforms import AttentionBackendEnum

    if enabled() and selected == AttentionBackendEnum.BLOCK_SPARSE_ATTN:
        component = get_component_attn_backend_name() or ""
        if component.startswith(DENSE_COMPONENTS):  # the platform's default, dense
            return original(head_size, dtype, supported, None)
        from ditops.integrations.sglang.attention import DitopsBlockSparseBackend

        return DitopsBlockSparseBackend
    return original(head_size, dtype, supported, selected)


def check_server_args(result: Any, server_args: Any) -> None:
    """After sglang built its arguments: refuse a bad config, say what ditops serves."""
    if not enabled():
        return None
    from sglang.multimodal_gen.runtime.platforms import current_platform

    from ditops.integrations.sglang.attention import config_from, device_type

    names = ", ".join(sorted(cls.__name__ for cls in served()))
    platform = type(current_platform).__name__
    device = device_type()
    log.warning("ditops (sglang plugin) on %s (%s): ditops runs %s", platform, device, names)
    if (getattr(server_args, "attention_backend", None) or "").lower() == "block_sparse_attn":
        config_from(server_args.attention_backend_config, device)
        pipeline = getattr(server_args, "pipeline_config", None)
        if getattr(pipeline, "is_causal", False):
            # CausalDMDDenoisingStage builds metadata for VIDEO_SPARSE_ATTN only: every
            # call would reach ditops' backend without it and run dense.
            raise ValueError(
                f"block_sparse_attn (ditops): {type(pipeline).__name__} is a causal "
                "(block-by-block, KV-cached) pipeline; its denoising stage builds attention "
                "metadata for video_sparse_attn only, so ditops' block-sparse attention "
                "would run dense there. Run it without --attention-backend "
                "block_sparse_attn (ditops' ops still serve it)"
            )
        if device not in SPARSE_KERNEL_DEVICES:
            log.warning(
                "ditops block_sparse_attn: platform %s's device %r has no ditops kernel "
                "for it; it runs ditops' plain-torch meaning there (%s have kernels)",
                platform, device, ", ".join(SPARSE_KERNEL_DEVICES),
            )  # fmt: skip
    return None


def ditops_error(error: BaseException | None) -> BaseException | None:
    """The first exception in ``error``'s chain raised inside ditops' code, if any."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        tb = error.__traceback__
        while tb is not None:
            if tb.tb_frame.f_globals.get("__name__", "").split(".")[0] == "ditops":
                if tb.tb_frame.f_code.co_name not in _HOOK_FRAMES:
                    return error
            tb = tb.tb_next
        error = error.__cause__ or error.__context__
    return None


def load_native_with_context(original: Any, *args: Any, **kwargs: Any) -> Any:
    """Refuse sglang's fallback to diffusers' class when ditops' code failed the build."""
    if enabled():
        error = ditops_error(sys.exc_info()[1])
        if error is not None:
            raise RuntimeError(
                f"ditops: building the model failed in ditops ({type(error).__name__}: "
                f"{error}); sglang's fallback to its native (diffusers) class is refused"
            ) from error
    return original(*args, **kwargs)


#: ditops' own hook frames (a failure passing through them is not ditops' failure).
_HOOK_FRAMES = {"dispatch_forward", "cached_get_attn_backend", "load_native_with_context"}


def hooks() -> list[tuple[str, Any, str]]:
    """(target, hook, hook type) for sglang's ``HookRegistry``."""
    return [
        (CUSTOM_OP, dispatch_forward, "AROUND"),
        (SELECTOR, cached_get_attn_backend, "AROUND"),
        (SERVER_ARGS, check_server_args, "AFTER"),
        (LOADER, load_native_with_context, "AROUND"),
    ]


def register_hooks() -> None:
    """Register :func:`hooks` with sglang (its plugin loader applies them)."""
    from sglang.multimodal_gen.runtime.platforms.plugins import HookRegistry, HookType

    for target, hook, kind in hooks():
        HookRegistry.register(target, hook, HookType[kind])
