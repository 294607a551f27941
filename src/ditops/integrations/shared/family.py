"""A model family, declared: what ditops fuses in a diffusers model, and the one
check -> plan -> apply that patches every declared family.

A family is a :class:`FamilySpec`, plain data:

* ``blocks``: :class:`Blocks` say where the blocks are (model attributes holding a
  ``ModuleList``, or one module such as ``norm_out``) and which :class:`Fused` kinds they
  may be. A kind is a diffusers forward ditops has a fused twin of, recognised by the
  fingerprint of the block class's forward (a copy under another class name is found; a
  changed forward is refused), with what the twin computes without calling
  (``bypasses``: what the guard watches and :func:`ditops.explain_patch` reports), the
  checks that refuse the model (``problems``) or leave that block unfused (``unfused``),
  and the attention submodules whose processors ditops wraps (an attention module with
  no prologue to fuse, ``plain``, keeps diffusers' processor).
* ``attention``: :class:`Attention`, diffusers' processor classes ditops wraps, with
  ditops' processor for each, the fingerprints of their ``__call__``, and whether a
  processor of another class (IP-Adapter's, the user's) is kept or refused.
* ``ops``: the op bundle of one patched model, built from the precision asked. This is
  the one way precision travels: fused forwards and processors take their ops from the
  bundle (:class:`Ops`).
* ``sparse``: :class:`Sparse`, where the patch size and the denoising step come from;
  ``None`` refuses ``attention=``, naming the families that serve it.
* ``relied_on``: every other diffusers function whose arithmetic the fused code
  reproduces, with the fingerprints of the versions checked.

:class:`DeclaredFamily` runs a spec: :meth:`~DeclaredFamily.check` looks at everything
before any change and refuses the model whole, naming every problem;
:meth:`~DeclaredFamily.apply` installs the fused forwards under the guard
(:func:`~ditops.integrations.shared.guard.install_guarded`) and the processors, recording
each change for ``unpatch``. Every processor is built the same way,
``cls(original, ops=..., steps=..., sparse=...)`` (``ops`` None when ``norms=False``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ditops.integrations.shared.base import (
    AttrSet,
    PatchOptions,
    PatchRecord,
    TorchHook,
    refuse,
    refuse_sparse,
    register_like,
)
from ditops.integrations.shared.fingerprint_table import Seen
from ditops.integrations.shared.fingerprints import (
    Relied,
    accepted,
    arithmetic,
    differs,
    fingerprint,
    match,
)
from ditops.integrations.shared.guard import forward_wrapper_problem, install_guarded
from ditops.integrations.shared.norms import swap_norms
from ditops.integrations.shared.steps import StepState, track_steps

#: The model attribute holding ``Plan.arithmetic`` while patched.
ARITHMETIC = "_ditops_arithmetic"
#: ``(module, where) -> problems`` (``where`` as in messages: ``blocks[3]``).
Check = Callable[[nn.Module, str], list[str]]


def _none(module: nn.Module, where: str) -> list[str]:
    return []


def _nothing() -> Relied:
    return {}


@dataclass(frozen=True)
class Fused:
    """A block forward ditops has a fused twin of."""

    #: What the diffusers forward is, in messages (``"FluxTransformerBlock.forward"``).
    label: str
    #: Fingerprints of that forward -> where seen, whose arithmetic (``fingerprints.known``).
    known: Mapping[str, Seen]
    #: The twin, ``forward(block, ops, *args, **kwargs)``: a module-level function.
    forward: Callable[..., Any]
    #: Submodules the twin computes without calling (see ``guard.Bypass``).
    bypasses: tuple[str, ...]
    #: Refuse the model: ``problems(block, where)`` (shapes the twin cannot compute).
    problems: Check = _none
    #: Leave this block unfused, with the reason (a norm of the user's): ``unfused(block,
    #: where)``; its first entry is the reason given.
    unfused: Check = _none
    #: The attention submodule(s) whose processors ditops wraps (None: none); one that is
    #: None on a block (SD3's ``attn2`` of a block without dual attention) is skipped.
    attention: str | tuple[str, ...] | None = None
    #: Checks of that attention module when the prologue is fused (``norms=True``).
    prologue: Check = _none
    #: Why an attention module has no prologue ditops fuses (no q/k norms): then its
    #: processor stays diffusers' (counted as kept, with the reason; the block is still
    #: fused) and ``prologue`` is not asked. Looked at without sparse attention only.
    plain: Check = _none
    #: Counted as ``"fused <kind>"`` / ``"unfused <kind>"``.
    kind: str = "blocks"

    def matches(self, cls: type) -> bool:
        return match(cls.forward, self.known) is not None


@dataclass(frozen=True)
class Blocks:
    """Where a family's blocks are and what they may be."""

    #: Model attributes: a ``ModuleList`` or ``ModuleDict`` of blocks, or one module
    #: (``"norm_out"``).
    attrs: tuple[str, ...]
    kinds: tuple[Fused, ...]
    #: Whether a model without any of them is refused.
    required: bool = False
    #: Looked at only when the blocks are fused (``norms=True``): an output norm.
    norms_only: bool = False


@dataclass(frozen=True)
class Attention:
    """diffusers' attention processors a family wraps."""

    #: diffusers' processor ``(module, class name)`` -> ditops' processor class, built as
    #: ``cls(original, ops=..., steps=..., sparse=...)``.
    processors: Mapping[tuple[str, str], type]
    #: Fingerprints of those processors' ``__call__`` (``fingerprints.known``).
    known: Mapping[str, Seen]
    #: A processor of another class: kept as it is (``True``; the block is still fused)
    #: or the model refused.
    keep_others: bool = False
    #: Why a wrapped processor runs diffusers' own prologue on this attention module (LTX-2's
    #: split rotary tables), or None: counted apart from the fused prologues.
    as_diffusers: Callable[[nn.Module], str | None] | None = None
    #: Further diffusers functions a processor calls (``_get_qkv_projections``), per
    #: ditops' processor class: ``relied(cls) -> Relied``.
    relied: Callable[[type], Relied] | None = None


@dataclass(frozen=True)
class Sparse:
    """How a family runs ``attention=BlockSparseConfig(...)``."""

    #: The model's patch size ``(t, h, w)``, or None (then refused).
    patch_size: Callable[[nn.Module], tuple[int, ...] | None]
    #: Count steps from the timesteps of calls that bring no step index.
    count_steps: bool = True
    #: A forward pre-hook to install with sparse attention, ``recorder(steps, model)``: for
    #: models taking packed tokens, whose grid (and step) a call names in its arguments
    #: (``video_sparse.grid_recorder``).
    recorder: Callable[[StepState, nn.Module], Any] | None = None
    #: Whether sparse steps run under diffusers' context parallelism (else a model whose
    #: processors carry a parallel config is refused; one enabled after the patch is
    #: refused by the processor at its first sparse call).
    context_parallel: bool = True


@dataclass(frozen=True)
class FamilySpec:
    """One family, declared (see the module docstring)."""

    name: str
    #: diffusers' class names of its models (the docs' families table lists them).
    model_classes: tuple[str, ...]
    #: What the patch does, in a few words (the docs' families table).
    summary: str
    blocks: tuple[Blocks, ...]
    #: ``ops(precision)``: the op bundle of one patched model.
    ops: Callable[[str | None], Any]
    attention: Attention | None = None
    sparse: Sparse | None = None
    relied_on: Callable[[], Relied] = _nothing
    #: Swap the model's other FP32LayerNorms too (``norms.swap_norms``).
    swap_norms: bool = False
    #: Also take a model of another class whose first block is of a known kind.
    by_blocks: bool = False
    #: Why the model as a whole leaves its prologues nothing to fuse (a setting of the
    #: model's, e.g. no rotary embedding), or None: ``plain_model(model)``. Without sparse
    #: attention its processors are then kept, and counted so.
    plain_model: Callable[[nn.Module], str | None] | None = None
    #: What else must hold of the whole model (``model_problems(model, options)``).
    model_problems: Callable[[nn.Module, PatchOptions], list[str]] | None = None


@dataclass
class Plan:
    """What :meth:`DeclaredFamily.apply` changes (all checked)."""

    #: (place, block, kind) of every block of a known kind.
    blocks: list[tuple[str, nn.Module, Fused]] = field(default_factory=list)
    #: place -> why it runs diffusers' forward.
    unfused: dict[str, str] = field(default_factory=dict)
    #: (attention module, ditops' processor class) to install.
    attentions: list[tuple[nn.Module, type]] = field(default_factory=list)
    #: processors left as they are ("blocks.3.attn: IPAdapterProcessor").
    kept: list[str] = field(default_factory=list)
    #: why the model leaves its prologues nothing to fuse (``FamilySpec.plain_model``).
    plain: str | None = None
    #: label -> the release whose arithmetic was matched (``explain_patch`` says it).
    arithmetic: dict[str, str] = field(default_factory=dict)


def _places(model: nn.Module, blocks: Blocks) -> Iterator[tuple[str, str, nn.Module]]:
    """(place, label in messages, module) of each block: ``blocks.3`` / ``blocks[3]``."""
    for attr in blocks.attrs:
        found = getattr(model, attr, None)
        if isinstance(found, nn.ModuleList):
            for i, block in enumerate(found):
                yield f"{attr}.{i}", f"{attr}[{i}]", block
        elif isinstance(found, nn.ModuleDict):  # Z-Image's final layers, by patch size
            for key, block in found.items():
                yield f"{attr}.{key}", f"{attr}[{key!r}]", block
        elif isinstance(found, nn.Module):
            yield attr, attr, found


class DeclaredFamily:
    """The :class:`~ditops.integrations.shared.base.ModelFamily` a :class:`FamilySpec` is."""

    def __init__(self, spec: FamilySpec) -> None:
        self.spec = spec
        self.name = spec.name
        self.model_classes = spec.model_classes
        self.summary = spec.summary
        self.sparse_attention = spec.sparse is not None

    def __repr__(self) -> str:
        return f"<family {self.name}>"

    def kind_of(self, cls: type) -> Fused | None:
        """The fused kind of a block class (by its forward's fingerprint), or None."""
        return next((k for b in self.spec.blocks for k in b.kinds if k.matches(cls)), None)

    def recognise(self, model: nn.Module) -> bool:
        if type(model).__name__ in self.model_classes:
            return True
        if not self.spec.by_blocks:
            return False
        first = next((m for b in self.spec.blocks for _, _, m in _places(model, b)), None)
        return first is not None and self.kind_of(type(first)) is not None

    def check(self, model: nn.Module, options: PatchOptions) -> Plan:
        """Everything the patch relies on, checked before any change. Raises PatchError."""
        import diffusers

        spec, plan, problems = self.spec, Plan(), []
        if options.attention is not None and spec.sparse is None:
            refuse_sparse(model, "blocks")
        if not options.norms and options.attention is None:
            return plan
        relied = spec.relied_on()
        problems += [p for p in map(_differs, relied.items()) if p]
        plan.arithmetic.update(arithmetic(relied))
        if spec.model_problems is not None:
            problems += spec.model_problems(model, options)
        if options.attention is not None and spec.sparse.patch_size(model) is None:  # type: ignore[union-attr]
            problems.append("sparse attention needs the model's config.patch_size (t, h, w)")
        version = getattr(diffusers, "__version__", "?")
        plan.plain = spec.plain_model(model) if spec.plain_model is not None else None
        kinds: dict[type, Fused | None] = {}
        for blocks in spec.blocks:
            if blocks.norms_only and not options.norms:
                continue
            places = list(_places(model, blocks))
            if blocks.required and not places:
                problems.append(f"the model has no {blocks.attrs[0]}")
            for where, label, block in places:
                cls = type(block)
                if cls not in kinds:
                    kinds[cls] = next((k for k in blocks.kinds if k.matches(cls)), None)
                kind = kinds[cls]
                if kind is None:
                    known = ", ".join(k.label for k in blocks.kinds)
                    problems.append(
                        f"{label} is a {cls.__name__} whose forward (fingerprint "
                        f"{fingerprint(cls.forward)}) is none ditops knows of diffusers "
                        f"{version} ({known}; {_seen(cls.forward, blocks.kinds)})"
                    )
                    continue
                plan.arithmetic[kind.label] = match(cls.forward, kind.known).arithmetic  # type: ignore[union-attr,assignment]
                found = kind.problems(block, label)
                found += self._attention(block, label, kind, options, plan)
                problems += found
                if found:
                    continue
                if options.norms:
                    why = [forward_wrapper_problem(block, label)] + kind.unfused(block, label)
                    why = [w for w in why if w]
                    if why:
                        plan.unfused[where] = why[0]
                plan.blocks.append((where, block, kind))
        refuse(model, problems)
        return plan

    def _attention(
        self, block: nn.Module, label: str, kind: Fused, options: PatchOptions, plan: Plan
    ) -> list[str]:
        """Check the processors of the block's attention modules; plan to wrap them."""
        names = (kind.attention,) if isinstance(kind.attention, str) else kind.attention or ()
        problems = []
        for name in names:
            attn = getattr(block, name, None)
            if attn is not None or len(names) == 1:
                problems += self._one_attention(attn, f"{label}.{name}", kind, options, plan)
        return problems

    def _one_attention(
        self, attn: nn.Module | None, where: str, kind: Fused, options: PatchOptions, plan: Plan
    ) -> list[str]:
        spec = self.spec.attention
        if spec is None:
            return []
        proc = getattr(attn, "processor", None)
        ours = spec.processors.get((type(proc).__module__, type(proc).__name__))
        if ours is None:
            if spec.keep_others and options.attention is None:
                plan.kept.append(f"{where}: {type(proc).__name__}")
                return []
            names = ", ".join(dict.fromkeys(n for _, n in spec.processors))
            return [f"{where}.processor is a {type(proc).__name__}, not {names}"]
        if options.attention is None and attn is not None:
            plain = [plan.plain] if plan.plain else kind.plain(attn, where)
            if plain:
                plan.kept.append(f"{where}: {type(proc).__name__} ({plain[0]})")
                return []
        problems = []
        call = type(proc).__call__
        label = f"{where}.processor {type(proc).__qualname__}.__call__"
        why = differs(label, call, spec.known, name_release=False)
        if why:
            problems.append(why)
        else:
            plan.arithmetic[f"{type(proc).__name__}.__call__"] = match(call, spec.known).arithmetic  # type: ignore[union-attr,assignment]
        if spec.relied is not None:
            relied = spec.relied(ours)
            problems += [p for p in map(_differs, relied.items()) if p]
            plan.arithmetic.update(arithmetic(relied))
        if options.norms:
            problems += kind.prologue(attn, where)  # type: ignore[arg-type]
        sparse = self.spec.sparse
        if options.attention is not None and sparse is not None and not sparse.context_parallel:
            if getattr(proc, "_parallel_config", None) is not None:
                problems.append(
                    f"{where}: sparse attention under context parallelism is not supported "
                    f"for {self.name}; patch with attention=None, or disable parallelism"
                )
        if not problems:
            plan.attentions.append((attn, ours))  # type: ignore[arg-type]
        return problems

    def apply(
        self, model: nn.Module, plan: Plan, record: PatchRecord, options: PatchOptions
    ) -> None:
        """Patch a checked model in place, recording every change on ``record``."""
        spec = self.spec
        ops = spec.ops(options.precision) if options.norms else None
        if plan.arithmetic:  # what explain_patch says was matched; unpatch removes it
            record.add(AttrSet.apply(model, ARITHMETIC, dict(sorted(plan.arithmetic.items()))))
        if options.norms:
            if spec.swap_norms:
                swap_norms(model, record, options.precision)
            for where, block, kind in plan.blocks:
                if where in plan.unfused:
                    record.count(f"unfused {kind.kind}")
                    record.unfused[where] = plan.unfused[where]
                else:
                    install_guarded(
                        block, kind.forward, ops, kind.bypasses, record, where, kind.kind
                    )
        steps = None
        if options.attention is not None:
            steps = StepState(count_steps=spec.sparse.count_steps)  # type: ignore[union-attr]
            steps.patch_size = spec.sparse.patch_size(model)  # type: ignore[union-attr]
            track_steps(model, steps, record)
            recorder = spec.sparse.recorder  # type: ignore[union-attr]
            if recorder is not None and hasattr(type(model), "cache_context"):
                record.add(TorchHook.register(model, recorder(steps, model)))
        if ops is None and steps is None:
            return
        for cls in {cls for _, cls in plan.attentions}:
            module, name = cls.wraps
            register_like(cls, getattr(importlib.import_module(module), name))
        for attn, cls in plan.attentions:
            sparse = None
            if options.attention is not None:
                from ditops.layers.sparse_attention import BlockSparseAttention

                sparse = BlockSparseAttention(options.attention)
                record.count("sparse self-attentions")
            processor = cls(attn.processor, ops=ops, steps=steps, sparse=sparse)
            record.add(AttrSet.apply(attn, "processor", processor))
            if ops is not None:
                as_diffusers = spec.attention.as_diffusers  # type: ignore[union-attr]
                why = as_diffusers(attn) if as_diffusers is not None else None
                record.count(
                    "fused attention prologues" if why is None
                    else f"attention prologues as diffusers' ({why})"
                )  # fmt: skip
        if plan.kept:
            record.count("attention processors kept", len(plan.kept))


def _differs(item: tuple[str, tuple[Callable[..., Any], Mapping[str, Seen]]]) -> str | None:
    label, (fn, table) = item
    return differs(label, fn, table)


def _seen(forward: Callable[..., Any], kinds: tuple[Fused, ...]) -> str:
    """What the table says of a forward no kind accepts: refused as which, or unknown."""
    fp = fingerprint(forward)
    for kind in kinds:
        seen = kind.known.get(fp)
        if seen is not None:
            return f"{kind.label} of {seen}, refused: {seen.note or 'another arithmetic'}"
    return f"ditops knows {'; '.join(f'{k.label} of {accepted(k.known)}' for k in kinds)}"
