"""What every model family's patch is made of: options, errors, the record of changes.

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
Also here: what every family checks with (:func:`refuse`; the fingerprints of the diffusers
functions reproduced are in :mod:`~ditops.integrations.shared.fingerprints`) and is
(:class:`ModelFamily`), and the base of ditops' attention processors.
"""

from __future__ import annotations

import importlib
import types
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

from torch import nn

from ditops.attention.schedule import BlockSparseConfig
from ditops.config import PRECISIONS


class PatchError(ValueError):
    """The model cannot be patched as asked; nothing was changed."""


@dataclass(frozen=True)
class PatchOptions:
    """What :func:`ditops.patch` was asked to do, validated when made.

    Attributes:
        norms: swap norms and, where the family supports it, fuse each block's
            norm / modulation / residual chain.
        attention: ``None`` (attention as it is) or a :class:`BlockSparseConfig`.
        precision: ``"exact"``, ``"fast"`` or ``None`` (follow ``DITOPS_PRECISION``).
    """

    norms: bool = True
    attention: BlockSparseConfig | None = None
    precision: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.norms, bool):
            raise PatchError(f"patch: norms must be True or False, got {self.norms!r}")
        if self.attention is not None and not isinstance(self.attention, BlockSparseConfig):
            hint = ""
            if isinstance(self.attention, (int, float)) and not isinstance(self.attention, bool):
                hint = f" (for sparsity {self.attention}: ditops.BlockSparseConfig(sparsity=...))"
            raise PatchError(
                "patch: attention must be None or a ditops.BlockSparseConfig, got "
                f"{type(self.attention).__name__} {self.attention!r}{hint}"
            )
        if self.precision is not None and self.precision not in PRECISIONS:
            raise PatchError(
                f"patch: precision must be one of {PRECISIONS} or None, got {self.precision!r}"
            )

    def describe(self) -> str:
        return ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))


# --- the changes a patch makes ------------------------------------------------------------


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


# --- model families ---------------------------------------------------------------------------


def is_plain_layer_norm(m: object) -> bool:
    """An ``nn.LayerNorm`` itself (no subclass) without affine parameters."""
    return type(m) is nn.LayerNorm and not m.elementwise_affine  # type: ignore[union-attr]


def _on_original(name: str) -> property:
    """An attribute read from and written to the wrapped ``original`` (None while unset)."""

    def get(self: WrappingProcessor) -> Any:
        return getattr(self.original, name, None)

    def set(self: WrappingProcessor, value: Any) -> None:
        setattr(self.original, name, value)

    return property(get, set)


class WrappingProcessor:
    """Base of the attention processors ditops installs over diffusers' own (``original``).

    diffusers writes the attention backend (``set_attention_backend``) and the
    context-parallel config (``enable_parallelism`` writes ``_parallel_config`` into every
    processor that has the attribute) on processors. Here both live on the original, read
    and written through, so they reach the code that runs the attention before and after
    the patch and survive ``unpatch``. A processor keeping its own would, under context
    parallelism, attend within each rank's shard: silently wrong.
    """

    #: The diffusers processor a subclass wraps: (module, class name).
    wraps: tuple[str, str] = ("", "")

    def __init__(self, original: Any) -> None:
        self.original = original

    @classmethod
    def original_processor(cls) -> Any:
        """A new processor of the diffusers class this one wraps: what ``type(p)()`` (as
        diffusers' loaders build processors) wraps."""
        module, name = cls.wraps
        return getattr(importlib.import_module(module), name)()

    _parallel_config = _on_original("_parallel_config")
    _attention_backend = _on_original("_attention_backend")

    def _dispatch_dense(self, query: Any, key: Any, value: Any, attention_mask: Any = None) -> Any:
        """Dense attention as diffusers' Wan and HunyuanVideo processors call it:
        ``dispatch_attention_fn`` with the wrapped processor's backend and context-parallel
        config (diffusers' own exchange, if any)."""
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        return dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=attention_mask,
            dropout_p=0.0,
            is_causal=False,
            backend=self._attention_backend,
            **self._parallel_kwargs(),
        )

    def _parallel_kwargs(self) -> dict[str, Any]:
        """``parallel_config=`` for ``dispatch_attention_fn`` when there is one: diffusers
        0.35 has no context parallelism and its ``dispatch_attention_fn`` no such argument
        (with None, later releases compute the same)."""
        config = self._parallel_config
        return {} if config is None else {"parallel_config": config}


class DenseProcessor(WrappingProcessor):
    """Base of ditops' processors that fuse the prologue of diffusers' dense attention
    (FLUX's, SD3's): no sparse attention. Built as ``cls(original, ops=...)``; built as
    diffusers' loaders build processors, ``type(p)()``, it wraps a new processor of the
    class it ``wraps`` and, with no ops, runs that processor's own code."""

    def __init__(
        self, original: Any | None = None, ops: Any = None, steps: Any = None, sparse: Any = None
    ) -> None:
        if original is None:
            original = self.original_processor()
        if sparse is not None:
            raise ValueError(f"{type(self).__name__}: this family has no sparse attention")
        super().__init__(original)
        self.ops = ops


def register_like(ours: type, theirs: type) -> None:
    """Tell diffusers' ``AttentionProcessorRegistry`` (what LayerSkip and other hooks look
    processors up in) that ``ours`` behaves as ``theirs`` (the processor it wraps) does,
    where diffusers registers ``theirs``; where it does not, both are refused alike."""
    try:
        from diffusers.hooks._helpers import AttentionProcessorRegistry
    except ImportError:  # an older diffusers without the registry: nothing looks there
        return
    try:
        metadata = AttentionProcessorRegistry.get(theirs)
    except ValueError:
        return
    AttentionProcessorRegistry.register(ours, metadata)


class ModelFamily(Protocol):
    """One kind of model ditops knows how to patch (one module per family)."""

    #: Shown in reports and errors, e.g. ``"wan"``.
    name: str
    #: diffusers' class names of the models it patches (empty: any model); what the docs'
    #: families table lists.
    model_classes: tuple[str, ...]
    #: Whether ``patch(..., attention=BlockSparseConfig(...))`` is served (else refused).
    sparse_attention: bool
    #: What the patch does, in a few words (the docs' families table).
    summary: str

    def recognise(self, model: nn.Module) -> bool:
        """Whether ``model`` belongs to this family."""
        ...

    def check(self, model: nn.Module, options: PatchOptions) -> Any:
        """Everything the patch relies on, checked before any change; returns a plan.

        Raises :class:`PatchError` naming every problem; changes nothing.
        """
        ...

    def apply(
        self, model: nn.Module, plan: Any, record: PatchRecord, options: PatchOptions
    ) -> None:
        """Patch in place, recording every change on ``record``."""
        ...


def refuse(model: nn.Module, problems: list[str]) -> None:
    """Raise the PatchError listing ``problems`` (at most 8), if there are any."""
    if problems:
        listed = "\n  - ".join(problems[:8]) + ("\n  - ..." if len(problems) > 8 else "")
        raise PatchError(
            f"ditops.patch refuses this {type(model).__name__}; nothing was changed:\n  - {listed}"
        )


#: The model classes of the families that serve sparse attention (``patching`` fills it
#: from its families), for the refusal the others give.
SPARSE_MODELS: list[str] = []


def refuse_sparse(model: nn.Module, what: str) -> None:
    """Raise the PatchError of a family without sparse attention asked for it."""
    raise PatchError(
        f"sparse attention is supported for {', '.join(SPARSE_MODELS)}, not for "
        f"{type(model).__name__}; call patch(..., attention=None) to patch its {what} only"
    )
