"""How a fused forward is installed, and when it steps aside (the ecosystem guard).

A fused forward computes some submodules of a module (its norms) without calling them.
:func:`install_guarded` makes it the module's own forward, *under* whatever already
wraps that forward (diffusers' ``HookRegistry`` chain, accelerate's ``_old_forward``:
:func:`replace_forward`), as a ``functools.partial`` of :func:`guarded_forward`, which
asks a :class:`Bypass` on every call whether anything is attached to a bypassed
submodule now (:func:`attached_to`: torch hooks, diffusers or accelerate hooks, a
forward replaced on the instance, a module of another class) and, if so, runs the
module's own (diffusers') forward instead, saying so once (:func:`note_unfused`).

The change records a patch keeps (:class:`~ditops.integrations.shared.undo.ForwardSwap`) are in
:mod:`ditops.integrations.shared.undo`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _torch_module

from ditops.integrations.shared.undo import ForwardSwap, PatchRecord
from ditops.tracing import traced

logger = logging.getLogger("ditops")


# --- replacing a forward under whatever wraps it --------------------------------------------


def own_forward_left(module: nn.Module, forward: Any) -> bool:
    """Whether ``forward`` (found on the instance) is the module's class forward bound to
    the module itself: what diffusers' ``HookRegistry.remove_hook`` leaves on the instance
    when the last hook goes (``enable_cache`` then ``disable_cache``). That is no wrapper
    and no hook: calling it is calling the module."""
    return (
        getattr(forward, "__self__", None) is module
        and getattr(forward, "__func__", None) is type(module).forward
    )


def forward_wrapper_problem(module: nn.Module, where: str) -> str | None:
    """Why the forward of ``module`` cannot be replaced under its wrappers, or None."""
    own = vars(module).get("forward")
    if not _innermost_slot(module) and own is not None and not own_forward_left(module, own):
        wrapper = vars(module)["forward"]
        return (
            f"{where}.forward is replaced by something ditops does not know "
            f"({getattr(wrapper, '__qualname__', type(wrapper).__name__)}); ditops patches "
            "under diffusers hooks and accelerate hooks only: apply ditops.patch first"
        )
    return None


def _innermost_slot(module: nn.Module) -> tuple[Any, str] | None:
    """The slot holding the module's own forward under hooks, if it is wrapped by any."""
    registry = vars(module).get("_diffusers_hook")
    refs = getattr(registry, "_fn_refs", None) or []
    if refs:
        ref = refs[0]  # the first hook registered wraps the module's own forward
        attr = "original_forward" if ref.original_forward is not None else "forward"
        return ref, attr
    if "_old_forward" in vars(module) and hasattr(module, "_hf_hook"):
        return module, "_old_forward"  # accelerate's add_hook_to_module
    return None


def replace_forward(module: nn.Module, patched: Callable[..., Any], record: PatchRecord) -> None:
    """Make ``patched`` the module's own forward, under any hook wrapping it.

    Call :func:`forward_wrapper_problem` first (in the family's check): this assumes the
    module's forward is either the class's or wrapped by known hooks.
    """
    slot = _innermost_slot(module)
    if slot is None:
        original = vars(module).get("forward")
        module.forward = patched  # type: ignore[method-assign]
    else:
        holder, attr = slot
        original = getattr(holder, attr)
        setattr(holder, attr, patched)
    record.add(ForwardSwap(module, patched, original))


# --- what others attached: run through it, or run unfused -------------------------------------


def attached_to(module: nn.Module) -> str | None:
    """What others attached to ``module`` that a fused forward would bypass, in words
    (the first thing found), or None: torch forward (pre-)hooks, diffusers hooks
    (``HookRegistry``: caching, group offloading, ...), accelerate hooks (sequential and
    model offload) or a forward replaced on the instance."""
    if module._forward_pre_hooks or module._forward_hooks:
        return "a torch forward hook"
    own = module.__dict__  # not getattr: nn.Module's __getattr__ raises for absent names
    registry = own.get("_diffusers_hook")
    if registry is not None and getattr(registry, "hooks", None):
        return f"diffusers hooks ({', '.join(registry.hooks)})"
    hf_hook = own.get("_hf_hook")
    if hf_hook is not None:
        return f"an accelerate hook ({type(hf_hook).__name__})"
    forward = own.get("forward")
    if (
        forward is not None
        and getattr(forward, "func", None) is not guarded_forward  # (ditops' own)
        and not own_forward_left(module, forward)
    ):
        return "a forward replaced on the instance"
    return None


def _global_hooks() -> bool:
    return bool(_torch_module._global_forward_hooks or _torch_module._global_forward_pre_hooks)


@dataclass(frozen=True)
class Bypass:
    """The submodules a fused forward computes without calling them, each with the class
    it must still have (the one it had when patched).

    :meth:`problem` is asked on every call, so hooks, offloading and modules set after the
    patch are seen when they arrive: a few dict lookups per bypassed module. Under
    ``torch.compile`` the answer is a guard (a change recompiles).
    """

    paths: tuple[tuple[str, type], ...]

    @classmethod
    def of(cls, root: nn.Module, names: tuple[str, ...]) -> Bypass:
        """``names`` with the class each has now; one the module lacks or holds as None
        (SD3's and Mochi's last ``norm2_context``) is watched as None by :meth:`problem`,
        so a module set there later runs the block unfused."""
        return cls(tuple((name, type(_submodule(root, name))) for name in names))

    def problem(self, root: nn.Module) -> str | None:
        """Why the fused forward must not run now (the first reason found), or None."""
        for name, cls in self.paths:
            module = _submodule(root, name)
            if type(module) is not cls:
                return f"{name} is a {type(module).__name__}, not the {cls.__name__} patched"
            if module is None:  # absent when patched (SD3's last norm2_context): still so
                continue
            what = attached_to(module)
            if what is not None:
                return f"{name} has {what}"
        if _global_hooks():
            return "global module forward hooks are registered"
        return None


def _submodule(root: nn.Module, name: str) -> Any:
    module: Any = root
    for part in name.split("."):
        module = getattr(module, part, None)
    return module


def guarded_forward(
    module: nn.Module,
    bypass: Bypass,
    fused: Callable[..., Any],
    ops: Any,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """``fused(module, ops, ...)`` when nothing attached to a module it bypasses, else the
    module's own (diffusers') forward, which calls every submodule through its hooks.

    Installed as ``functools.partial(guarded_forward, module, bypass, fused, ops)``.
    """
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    reason = FLOAT64 if float64_call(hidden) else bypass.problem(module)
    if reason is None:
        return fused(module, ops, *args, **kwargs)
    if not traced():
        note_unfused(module, reason)
    return type(module).forward(module, *args, **kwargs)


#: Why a float64 call runs diffusers' own code (a model cast to float64 after its patch:
#: ``patch`` refuses float64 models, see ``patching._refuse_float64``).
FLOAT64 = (
    "a float64 call runs diffusers' own code: ditops' fused ops and sparse attention take "
    "float32, bfloat16 and float16"
)
_float64_said: list[bool] = []


def float64_call(hidden_states: object) -> bool:
    """Whether a call brings float64 activations; says so once (WARNING, ``ditops``)."""
    if not (isinstance(hidden_states, torch.Tensor) and hidden_states.dtype == torch.float64):
        return False
    if not _float64_said and not traced():
        _float64_said.append(True)
        logger.warning("ditops: %s", FLOAT64)
    return True


def note_unfused(module: nn.Module, reason: str) -> None:
    """Say once per module and reason (INFO, ``ditops`` logger) that it ran unfused."""
    said = module.__dict__.setdefault("_ditops_unfused", {})
    if reason not in said:
        said[reason] = True
        logger.info("ditops: %s runs unfused: %s", type(module).__name__, reason)


def install_guarded(
    module: nn.Module,
    fused: Callable[..., Any],
    ops: Any,
    bypassed: tuple[str, ...],
    record: PatchRecord,
    where: str,
    kind: str = "blocks",
) -> None:
    """Make ``module`` (at ``where`` in the model) run ``fused`` through
    :func:`guarded_forward`, under its hooks, and count it as ``"fused <kind>"`` or
    ``"unfused <kind>"`` as things stand (the reason in ``record.unfused``)."""
    bypass = Bypass.of(module, bypassed)
    replace_forward(module, functools.partial(guarded_forward, module, bypass, fused, ops), record)
    record.targets[where] = (module, bypass)
    reason = bypass.problem(module)
    if reason is None:
        record.count(f"fused {kind}")
    else:
        record.count(f"unfused {kind}")
        record.unfused[where] = reason
