"""``ditops.patch`` / ``ditops.unpatch``: make a diffusers model faster in place, and undo it.

:func:`patch` finds the model family (:data:`FAMILIES`, first match wins; the last, the
generic norm swap, takes any model), has it check the model (a
model that does not match what the patch expects is refused whole, nothing changed) and
apply the patch, recording every change on the model (``model._ditops_patch``, see
:mod:`ditops.integrations.shared.base`).

Calling :func:`patch` again combines: options given in the new call replace the ones in
force, options left out keep their value, so ``patch(m, precision="exact")`` then
``patch(m, attention=cfg)`` gives exact norms *and* sparse attention (pass
``attention=None`` to drop it). The same options again change nothing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from ditops.attention.block_mask import MaskDensity
from ditops.attention.schedule import BlockSparseConfig
from ditops.integrations.chroma.family import SPEC as CHROMA
from ditops.integrations.cogvideox.family import SPEC as COGVIDEOX
from ditops.integrations.flux.family import SPEC as FLUX
from ditops.integrations.flux2.family import SPEC as FLUX2
from ditops.integrations.hunyuan_video.family import FRAMEPACK
from ditops.integrations.hunyuan_video.family import SPEC as HUNYUAN_VIDEO
from ditops.integrations.hunyuan_video.v15 import SPEC as HUNYUAN_VIDEO15
from ditops.integrations.ltx2.family import SPEC as LTX2
from ditops.integrations.ltx_video.family import SPEC as LTX_VIDEO
from ditops.integrations.mochi.family import SPEC as MOCHI
from ditops.integrations.qwen_image.family import SPEC as QWEN_IMAGE
from ditops.integrations.sd3.family import SPEC as SD3
from ditops.integrations.shared.base import (
    SPARSE_MODELS,
    ModelFamily,
    PatchError,
    PatchOptions,
    PatchRecord,
)
from ditops.integrations.shared.family import ARITHMETIC, DeclaredFamily
from ditops.integrations.shared.norms import GenericFamily, has_swappable_norms
from ditops.integrations.shared.steps import StepState
from ditops.integrations.wan.family import SPEC as WAN
from ditops.integrations.z_image.family import SPEC as Z_IMAGE

logger = logging.getLogger("ditops")

#: The model families ditops knows, most specific first; the last one takes any model.
FAMILIES: tuple[ModelFamily, ...] = (
    DeclaredFamily(WAN),
    DeclaredFamily(FLUX),
    DeclaredFamily(FLUX2),
    DeclaredFamily(MOCHI),
    DeclaredFamily(HUNYUAN_VIDEO),
    DeclaredFamily(HUNYUAN_VIDEO15),
    DeclaredFamily(FRAMEPACK),
    DeclaredFamily(LTX_VIDEO),
    DeclaredFamily(LTX2),
    DeclaredFamily(SD3),
    DeclaredFamily(CHROMA),
    DeclaredFamily(QWEN_IMAGE),
    DeclaredFamily(Z_IMAGE),
    DeclaredFamily(COGVIDEOX),
    GenericFamily(),
)
SPARSE_MODELS[:] = [c for f in FAMILIES if f.sparse_attention for c in f.model_classes]


class _Unset:
    """The default of :func:`patch`'s options: keep what is in force."""

    def __repr__(self) -> str:
        return "<unset>"


UNSET: Any = _Unset()


@dataclass
class PatchReport:
    """What :func:`patch` changed, per patched model (by attribute name in a pipeline), and
    which places run unfused, with the reason (``unfused[model][place]``)."""

    models: dict[str, dict[str, int]]
    unfused: dict[str, dict[str, str]] = field(default_factory=dict)
    #: Components of a pipeline left as they were: nothing in them to patch (why).
    nothing: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        parts = [f"{name}: nothing to patch ({why})" for name, why in self.nothing.items()]
        for name, summary in self.models.items():
            what = ", ".join(f"{n} {k}" for k, n in sorted(summary.items())) or "nothing"
            why = self.unfused.get(name)
            if why:
                shown = "; ".join(f"{place}: {reason}" for place, reason in list(why.items())[:3])
                more = f"; and {len(why) - 3} more" if len(why) > 3 else ""
                what += f" (unfused: {shown}{more})"
            parts.append(f"{name}: {what}")
        return "; ".join(parts)


def unwrap_compiled(module: nn.Module) -> nn.Module:
    """The model a ``torch.compile`` wrapper (``OptimizedModule``) holds, else ``module``.

    Patching the wrapped model in place is what the wrapper then runs: dynamo guards on
    the forwards and processors it traced, so the next call retraces the patched model.
    """
    inner = getattr(module, "_orig_mod", None)
    if type(module).__name__ == "OptimizedModule" and isinstance(inner, nn.Module):
        return inner
    return module


def _models_of(target: Any) -> dict[str, nn.Module]:
    if isinstance(target, nn.Module):
        model = unwrap_compiled(target)
        return {type(model).__name__: model}
    components = getattr(target, "components", None)
    if isinstance(components, dict):
        found = {
            name: unwrap_compiled(m)
            for name, m in components.items()
            if isinstance(m, nn.Module) and name.startswith("transformer")
        }
        if found:
            return found
    raise PatchError(
        f"patch expects a diffusers model (nn.Module) or a pipeline with transformer "
        f"components, got {type(target).__name__}"
    )


def nothing_to_patch(model: nn.Module, family: ModelFamily, options: PatchOptions) -> str:
    """Why patching ``model`` as asked could change nothing in any precision ("" when
    it can): a model no family recognises (the generic patch: norms only) with no
    FP32LayerNorm or nn.LayerNorm. A single such model is refused (a silent "nothing"
    reads as success); a pipeline lists such components in its report."""
    if family.name != "generic" or not options.norms or has_swappable_norms(model):
        return ""
    deeper = ", ".join(c for f in FAMILIES for c in f.model_classes)
    return (
        f"{type(model).__name__} has no FP32LayerNorm or nn.LayerNorm, what ditops patches "
        f"in any model, and is none of the models with a deeper patch ({deeper})"
    )


def family_of(model: nn.Module) -> ModelFamily:
    """The first family in :data:`FAMILIES` that recognises ``model``."""
    return next(f for f in FAMILIES if f.recognise(model))


def _keep_hand_set_step(model: nn.Module, undone: list[PatchRecord]) -> None:
    """A step set by hand (``set_step``) before a re-patch holds after it, as the other
    options left out do: the new step state takes it from the one the old patch set."""
    new = vars(model).get("_ditops_steps")
    if new is None:
        return
    for record in undone:
        for change in record.changes:
            old = getattr(change, "value", None)
            if getattr(change, "obj", None) is model and isinstance(old, StepState):
                new.manual = old.manual


def _refuse_float64(model: nn.Module, family: ModelFamily, options: PatchOptions) -> None:
    """Refuse a float64 model where ditops would fuse blocks or run sparse attention.

    In float64 the fused blocks are not bitwise diffusers' arithmetic (diffusers rotates
    q/k in fp32, the ops in the input dtype), and the mask estimate takes no float64:
    refused here rather than a silent difference, or a TypeError at the first sparse step.
    The generic family (norms only) computes as the FP32LayerNorm it replaces.
    """
    fuses = family.name != "generic" and (options.norms or options.attention is not None)
    if fuses and any(p.dtype == torch.float64 for p in model.parameters()):
        raise PatchError(
            f"ditops.patch refuses this {type(model).__name__}: it is float64; nothing was "
            "changed. ditops' fused blocks and sparse attention take float32, bfloat16 and "
            "float16 (in float64 the fused arithmetic would not be bitwise diffusers', and "
            "the mask estimate takes no float64): patch the model in one of those dtypes, "
            "or run it unpatched (patch(..., norms=False, attention=None) changes nothing)"
        )


def patch(
    target: Any,
    *,
    norms: bool = UNSET,
    attention: BlockSparseConfig | None = UNSET,
    precision: str | None = UNSET,
) -> PatchReport:
    """Patch a diffusers model, or every transformer of a pipeline, in place.

    Args:
        target: a model (``nn.Module``, or ``torch.compile``'s wrapper of one) or a
            pipeline (its ``transformer*`` components).
        norms: swap norms and, on the families that declare fused blocks (every family
            but the generic one), fuse each block's modulation chain and attention
            prologue (default True).
        attention: ``None`` (dense attention as it is; the default) or a
            :class:`ditops.BlockSparseConfig` for the self-attention of the families that
            declare it (the "sparse self-attention" column of the docs' families table,
            written from the declarations); the others refuse it, naming the model
            classes that take it.
        precision: ``"exact"``, ``"fast"`` or ``None`` (follow ``DITOPS_PRECISION`` per
            call; the default).

    Options left out keep the value of an earlier patch of the same model (see the
    module docstring). All or nothing: every model of a pipeline and every option is
    checked before anything changes, and a refusal (:class:`PatchError`) leaves every
    model as it was (a patched one stays patched, with its options). Returns what
    changed (also logged at INFO on the ``ditops`` logger).
    """
    given = {
        k: v
        for k, v in (("norms", norms), ("attention", attention), ("precision", precision))
        if v is not UNSET
    }
    PatchOptions(**given)  # validate before looking at the target
    models = _models_of(target)
    report: dict[str, dict[str, int]] = {}
    unfused: dict[str, dict[str, str]] = {}
    nothing: dict[str, str] = {}  # pipeline components with nothing to patch: why
    todo: list[tuple[str, nn.Module, ModelFamily, Any, PatchOptions]] = []
    undone: list[PatchRecord] = []  # earlier patches taken off to check the new options
    try:
        for name, model in models.items():
            existing: PatchRecord | None = vars(model).get("_ditops_patch")
            options = replace(existing.options, **given) if existing else PatchOptions(**given)
            if existing is not None:
                if existing.options == options:
                    report[name], unfused[name] = dict(existing.summary), dict(existing.unfused)
                    continue
                existing.undo()
                undone.append(existing)
            family = family_of(model)
            _refuse_float64(model, family, options)
            plan = family.check(model, options)  # its refusals (sparse asked) first
            why = nothing_to_patch(model, family, options)
            if why:
                nothing[name] = why
                continue
            todo.append((name, model, family, plan, options))
        if nothing and (isinstance(target, nn.Module) or len(nothing) == len(models)):
            raise PatchError(
                f"ditops.patch: nothing to patch: {'; '.join(nothing.values())}; nothing "
                "was changed"
            )
        done: list[tuple[nn.Module, PatchRecord]] = []
        try:
            for name, model, family, plan, options in todo:
                record = PatchRecord(options, family.name)
                done.append((model, record))
                family.apply(model, plan, record, options)
                report[name], unfused[name] = dict(record.summary), dict(record.unfused)
                _keep_hand_set_step(model, undone)
        except BaseException:
            for _, record in reversed(done):
                record.undo()
            raise
    except BaseException:
        for record in undone:
            record.redo()
        raise
    for model, record in done:
        model._ditops_patch = record  # type: ignore[assignment]
    result = PatchReport(report, {k: v for k, v in unfused.items() if v}, nothing)
    for name, why in nothing.items():
        logger.warning("ditops.patch: %s: nothing to patch, left as it is (%s)", name, why)
    logger.info("ditops.patch: %s", result)
    return result


def explain_patch(target: Any) -> dict[str, dict[str, str]]:
    """Where each patched model runs fused now, and where not and why.

    Asked now, not when patched: hooks, offloading and modules set since count. Returns
    ``{model: {place: "fused" | reason}}`` (places as in ``named_modules``), and under the
    place ``""`` (the model itself) the diffusers installed and whose arithmetic each
    relied-on function was matched to (``"diffusers 0.42.1: arithmetic of 0.42"``).
    """
    out: dict[str, dict[str, str]] = {}
    for name, model in _models_of(target).items():
        record: PatchRecord | None = vars(model).get("_ditops_patch")
        if record is None:
            out[name] = {}
            continue
        places = {place: why for place, why in record.unfused.items()}
        for place, (module, bypass) in record.targets.items():
            places[place] = bypass.problem(module) or "fused"
        matched = vars(model).get(ARITHMETIC)
        if matched:
            places[""] = _arithmetic_line(matched)
        out[name] = dict(sorted(places.items()))
    return out


def _arithmetic_line(matched: dict[str, str]) -> str:
    """``"diffusers 0.42.1: arithmetic of 0.42"`` (each variant with its functions when
    more than one was matched)."""
    import diffusers

    by: dict[str, list[str]] = {}
    for label, release in matched.items():
        by.setdefault(release, []).append(label)
    if len(by) == 1:
        return f"diffusers {diffusers.__version__}: arithmetic of {next(iter(by))}"
    parts = "; ".join(f"of {r} for {', '.join(labels)}" for r, labels in sorted(by.items()))
    return f"diffusers {diffusers.__version__}: arithmetic {parts}"


def sparse_densities(target: Any) -> dict[str, dict[str, MaskDensity | None]]:
    """The density each sparse self-attention of a patched model ran at its last eager
    sparse call: ``{model: {attention place: MaskDensity | None}}`` (``None``: dense, or
    no sparse call yet; places as in ``named_modules``).

    The density asked (``1 - sparsity``) counts every family's forced dense part (the
    first frame, and what a family keeps dense with it: HunyuanVideo-Framepack's text,
    history and clean latents); where that part alone is more, only it runs, with a
    warning, and this is where the density that ran is read. With a mass target it is
    the density the scores needed.
    """
    from ditops.layers.sparse_attention import BlockSparseAttention

    out: dict[str, dict[str, MaskDensity | None]] = {}
    for name, model in _models_of(target).items():
        found: dict[str, MaskDensity | None] = {}
        for place, module in model.named_modules():
            sparse = getattr(getattr(module, "processor", None), "sparse", None)
            if isinstance(sparse, BlockSparseAttention):
                found[place] = sparse.last_density()
        out[name] = found
    return out


def unpatch(target: Any) -> None:
    """Undo :func:`patch`: the model comes back as it is now, less ditops' changes.

    The norms ditops made its own get their class back (their current parameters, hooks
    and offloading stay theirs); processors and modules set by anyone since the patch stay
    as they were set. A no-op on an unpatched model.
    """
    for model in _models_of(target).values():
        record: PatchRecord | None = vars(model).get("_ditops_patch")
        if record is None:
            continue
        record.undo()
        del model._ditops_patch
