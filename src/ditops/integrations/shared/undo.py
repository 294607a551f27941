"""The undo log of a patch: the record of every change it made to a model.

A patch changes a model in place through a few kinds of change, each recorded as plain
data on the model (``model._ditops_patch``) so that :func:`ditops.unpatch` restores the
very same objects:

* :class:`ClassSwap`: a module's class changed in place (a norm becomes ditops' norm: the
  same object, so its parameters, hooks and offloading stay its own);
* :class:`ForwardSwap`: a module's forward replaced, *under* the hooks already wrapping
  it (diffusers' ``HookRegistry`` chain, accelerate's ``_old_forward``), so hooks
  registered before the patch keep running around the patched forward, as if they had
  been registered after it;
* :class:`AttrSet`: an attribute set on an object (an attention processor, a
  ``cache_context`` that also tells ditops the denoising step);
* :class:`TorchHook`: a ``torch.nn.Module`` forward pre-hook.

Every change undoes only what is still its own: a processor or module the user set after
the patch stays the user's. Each can also be redone, so a patch that is refused leaves a
patched model patched as it was (:func:`ditops.patch` checks with the old patch undone).

Nothing here holds a closure or a lock: a record references modules and module-level
callables only, so ``copy.deepcopy(model)`` gives an independent patched copy (the copy's
record points at the copy's modules) and a patched model pickles (``torch.save``) as long
as the rest of it does.

Installing a fused forward under those hooks, and the guard that runs the module's own
forward while something is attached to what it bypasses: :mod:`ditops.integrations.shared.guard`.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ditops.integrations.shared.options import PatchOptions


@dataclass
class ClassSwap:
    """``module`` was of class ``original``; the patch made it a ``patched`` (a subclass
    sharing its state), with ``precision``."""

    module: nn.Module
    original: type
    patched: type
    precision: str | None

    def undo(self) -> None:
        if type(self.module) is self.patched:  # not if someone changed it since
            self.module.__class__ = self.original
            vars(self.module).pop("_precision", None)

    def redo(self) -> None:
        if type(self.module) is self.original:
            self.module.__class__ = self.patched
            self.module.precision = self.precision  # type: ignore[attr-defined]


_MISSING = object()


@dataclass
class AttrSet:
    """``obj.<name>`` was ``old`` (``had`` False: it was not set on the object itself)."""

    obj: Any
    name: str
    had: bool
    old: Any = None
    value: Any = None

    @classmethod
    def apply(cls, obj: Any, name: str, value: Any) -> AttrSet:
        """Set ``obj.<name> = value`` and return the change that undoes it."""
        old = vars(obj).get(name, _MISSING) if hasattr(obj, "__dict__") else _MISSING
        change = cls(obj, name, old is not _MISSING, None if old is _MISSING else old, value)
        setattr(obj, name, value)
        return change

    def undo(self) -> None:
        if getattr(self.obj, self.name, _MISSING) is not self.value:
            return  # set by someone else since (a processor of the user's): theirs stays
        if self.had:
            setattr(self.obj, self.name, self.old)
        else:
            vars(self.obj).pop(self.name, None)

    def redo(self) -> None:
        if vars(self.obj).get(self.name, _MISSING) is (self.old if self.had else _MISSING):
            setattr(self.obj, self.name, self.value)


@dataclass
class TorchHook:
    """A forward pre-hook registered on ``module`` under ``hook_id``."""

    module: nn.Module
    hook_id: int
    hook: Callable[..., Any] | None = None

    @classmethod
    def register(cls, module: nn.Module, hook: Callable[..., Any]) -> TorchHook:
        """Register ``hook`` (a pre-hook taking kwargs) and return the change."""
        handle = module.register_forward_pre_hook(hook, with_kwargs=True)
        return cls(module, handle.id, hook)

    def undo(self) -> None:
        self.module._forward_pre_hooks.pop(self.hook_id, None)
        self.module._forward_pre_hooks_with_kwargs.pop(self.hook_id, None)

    def redo(self) -> None:
        if self.hook is not None and self.hook_id not in self.module._forward_pre_hooks:
            handle = self.module.register_forward_pre_hook(self.hook, with_kwargs=True)
            self.hook_id = handle.id


def _forward_slots(module: nn.Module) -> list[tuple[Any, str]]:
    """Every place a call of ``module`` may find its own forward: the instance attribute,
    accelerate's ``_old_forward`` and each link of a diffusers hook chain."""
    slots: list[tuple[Any, str]] = [(module, "forward"), (module, "_old_forward")]
    registry = vars(module).get("_diffusers_hook")
    for ref in getattr(registry, "_fn_refs", ()) or ():
        slots.extend([(ref, "forward"), (ref, "original_forward")])
    return slots


@dataclass
class ForwardSwap:
    """``module``'s own forward was replaced by ``patched`` wherever it is called from."""

    module: nn.Module
    patched: Callable[..., Any]
    original: Callable[..., Any] | None  # None: the class's forward (nothing on the instance)
    undone: list[tuple[Any, str]] = field(default_factory=list)

    def undo(self) -> None:
        # Hooks registered after the patch captured the patched forward: every slot that
        # holds it gets the original back (the class's forward, bound, if there was none).
        original = self.original
        if original is None:
            original = types.MethodType(type(self.module).forward, self.module)
        self.undone = []
        for holder, attr in _forward_slots(self.module):
            if getattr(holder, attr, None) is self.patched:
                self.undone.append((holder, attr))
                if holder is self.module and attr == "forward" and self.original is None:
                    vars(self.module).pop("forward", None)
                else:
                    setattr(holder, attr, original)

    def redo(self) -> None:
        for holder, attr in self.undone:
            setattr(holder, attr, self.patched)
        self.undone = []


Change = ClassSwap | AttrSet | TorchHook | ForwardSwap


@dataclass
class PatchRecord:
    """What a patch changed on one model, to undo it exactly (plain data, see module doc)."""

    options: PatchOptions
    family: str
    changes: list[Change] = field(default_factory=list)
    summary: dict[str, int] = field(default_factory=dict)
    #: Fused forwards by place (``"blocks.3"``): the module and what it bypasses.
    targets: dict[str, tuple[nn.Module, Any]] = field(default_factory=dict)
    #: Places that ran unfused when patched, with the reason.
    unfused: dict[str, str] = field(default_factory=dict)

    def add(self, change: Change) -> None:
        self.changes.append(change)

    def count(self, what: str, n: int = 1) -> None:
        self.summary[what] = self.summary.get(what, 0) + n

    def undo(self) -> None:
        """Undo every change, newest first (they stay listed, for :meth:`redo`)."""
        for change in reversed(self.changes):
            change.undo()

    def redo(self) -> None:
        """Make an undone patch as it was again (a refused re-patch)."""
        for change in self.changes:
            change.redo()
