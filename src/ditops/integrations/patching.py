"""``ditops.patch`` / ``ditops.unpatch``: make a diffusers model faster in place, and undo it.

:func:`patch` finds the model family (:data:`FAMILIES`, first match wins: Wan, FLUX,
HunyuanVideo, HunyuanVideo-1.5, then the generic norm swap), has it check the model (a
model that does not match what the patch expects is refused whole, nothing changed) and
apply the patch, recording every change on the model (``model._ditops_patch``, see
:mod:`ditops.integrations.base`).

Calling :func:`patch` again combines: options given in the new call replace the ones in
force, options left out keep their value, so ``patch(m, precision="exact")`` then
``patch(m, attention=cfg)`` gives exact norms *and* sparse attention (pass
``attention=None`` to drop it). The same options again change nothing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from ditops.attention.schedule import BlockSparseConfig
from ditops.integrations.base import ModelFamily, PatchError, PatchOptions, PatchRecord
from ditops.integrations.flux import FluxFamily
from ditops.integrations.hunyuan_video import HunyuanVideoFamily
from ditops.integrations.hunyuan_video15 import HunyuanVideo15Family
from ditops.integrations.norms import GenericFamily
from ditops.integrations.wan import WanFamily

logger = logging.getLogger("ditops")

#: The model families ditops knows, most specific first; the last one takes any model.
FAMILIES: tuple[ModelFamily, ...] = (
    WanFamily(),
    FluxFamily(),
    HunyuanVideoFamily(),
    HunyuanVideo15Family(),
    GenericFamily(),
)


class _Unset:
    """The default of :func:`patch`'s options: keep what is in force."""

    def __repr__(self) -> str:
        return "<unset>"


UNSET: Any = _Unset()


@dataclass
class PatchReport:
    """What :func:`patch` changed, per patched model (by attribute name in a pipeline)."""

    models: dict[str, dict[str, int]]

    def __str__(self) -> str:
        parts = []
        for name, summary in self.models.items():
            what = ", ".join(f"{n} {k}" for k, n in sorted(summary.items())) or "nothing"
            parts.append(f"{name}: {what}")
        return "; ".join(parts)


def _models_of(target: Any) -> dict[str, nn.Module]:
    if isinstance(target, nn.Module):
        return {type(target).__name__: target}
    components = getattr(target, "components", None)
    if isinstance(components, dict):
        found = {
            name: m
            for name, m in components.items()
            if isinstance(m, nn.Module) and name.startswith("transformer")
        }
        if found:
            return found
    raise PatchError(
        f"patch expects a diffusers model (nn.Module) or a pipeline with transformer "
        f"components, got {type(target).__name__}"
    )


def family_of(model: nn.Module) -> ModelFamily:
    """The first family in :data:`FAMILIES` that recognises ``model``."""
    return next(f for f in FAMILIES if f.recognise(model))


def patch(
    target: Any,
    *,
    norms: bool = UNSET,
    attention: BlockSparseConfig | None = UNSET,
    precision: str | None = UNSET,
) -> PatchReport:
    """Patch a diffusers model, or every transformer of a pipeline, in place.

    Args:
        target: a model (``nn.Module``) or a pipeline (its ``transformer*`` components).
        norms: swap norms and, on Wan, FLUX and HunyuanVideo(-1.5), fuse each block's
            modulation chain and attention prologue (default True).
        attention: ``None`` (dense attention as it is; the default) or a
            :class:`ditops.BlockSparseConfig` for Wan's and HunyuanVideo(-1.5)'s
            self-attention.
        precision: ``"exact"``, ``"fast"`` or ``None`` (follow ``DITOPS_PRECISION`` per
            call; the default).

    Options left out keep the value of an earlier patch of the same model (see the
    module docstring). Bad options raise :class:`PatchError` before anything changes.
    Returns what changed (also logged at INFO on the ``ditops`` logger).
    """
    given = {
        k: v
        for k, v in (("norms", norms), ("attention", attention), ("precision", precision))
        if v is not UNSET
    }
    PatchOptions(**given)  # validate before looking at the target
    report: dict[str, dict[str, int]] = {}
    for name, model in _models_of(target).items():
        existing: PatchRecord | None = getattr(model, "_ditops_patch", None)
        options = replace(existing.options, **given) if existing else PatchOptions(**given)
        if existing is not None:
            if existing.options == options:
                report[name] = dict(existing.summary)
                continue
            unpatch(model)
        report[name] = _patch_model(model, options)
    result = PatchReport(report)
    logger.info("ditops.patch: %s", result)
    return result


def _patch_model(model: nn.Module, options: PatchOptions) -> dict[str, int]:
    family = family_of(model)
    plan = family.check(model, options)  # raises before any change
    record = PatchRecord(options, family.name)
    try:
        family.apply(model, plan, record, options)
    except BaseException:
        record.undo()
        raise
    model._ditops_patch = record  # type: ignore[assignment]
    return dict(record.summary)


def unpatch(target: Any) -> None:
    """Undo :func:`patch`: the original modules and methods come back (a no-op if unpatched)."""
    for model in _models_of(target).values():
        record: PatchRecord | None = vars(model).get("_ditops_patch")
        if record is None:
            continue
        record.undo()
        del model._ditops_patch
