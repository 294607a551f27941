"""``ditops.patch`` / ``ditops.unpatch``: make a diffusers model faster in place, and undo it.

What a patch does, by model:

* ``WanTransformer3DModel``: every ``FP32LayerNorm`` becomes ditops' (same parameters);
  each block's norm / modulation / gated-residual chain runs on ditops' fused ops
  (:mod:`ditops.integrations.wan`); with ``attention=`` a sparse config, self-attention
  runs block-sparse on the denoising schedule.
* any other model (FLUX, HunyuanVideo, ...): its ``FP32LayerNorm`` modules (diffusers' or
  any subclass of ``nn.LayerNorm`` named so) become ditops' FP32LayerNorm; plain
  ``nn.LayerNorm`` modules, which compute in the model dtype, are swapped only in
  ``fast`` precision, where fp32 inside stays within tolerance (in ``exact`` they stay:
  ditops' meaning is not theirs bit for bit).

Every change is recorded on the model (``model._ditops_patch``), so :func:`unpatch`
restores the very same modules and methods; patching again with the same options does
nothing, with other options it first undoes the previous patch. Checks run before any
change: a model that does not match what a patch expects is refused whole.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ditops.config import PRECISIONS
from ditops.layers.norm import FP32LayerNorm

logger = logging.getLogger("ditops")


class PatchError(ValueError):
    """The model cannot be patched as asked; nothing was changed."""


@dataclass
class PatchRecord:
    """What a patch changed on one model, to undo it exactly."""

    options: tuple[Any, ...]
    modules: list[tuple[nn.Module, str, nn.Module]] = field(default_factory=list)
    undo: list[Callable[[], None]] = field(default_factory=list)
    summary: dict[str, int] = field(default_factory=dict)

    def count(self, what: str, n: int = 1) -> None:
        self.summary[what] = self.summary.get(what, 0) + n


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


def _is_fp32_layer_norm(m: nn.Module) -> bool:
    return isinstance(m, nn.LayerNorm) and type(m).__name__ == "FP32LayerNorm"


def swap_norms(model: nn.Module, record: PatchRecord, precision: str | None) -> None:
    """Replace FP32LayerNorm (and, in fast precision, nn.LayerNorm) modules by ditops'."""
    plain_too = (precision or "fast") == "fast"
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, FP32LayerNorm):
                continue
            if _is_fp32_layer_norm(child) or (plain_too and type(child) is nn.LayerNorm):
                new = FP32LayerNorm.from_module(child)  # type: ignore[arg-type]
                new.precision = precision
                setattr(parent, name, new)
                record.modules.append((parent, name, child))
                record.count("norms")


def _patch_model(
    model: nn.Module, norms: bool, attention: Any, precision: str | None, record: PatchRecord
) -> None:
    from ditops.integrations import wan

    if wan.is_wan(model):
        plan = wan.check(model, norms=norms, attention=attention)  # raises before any change
        wan.apply(model, plan, record, norms=norms, attention=attention, precision=precision)
        return
    if attention is not None:
        raise PatchError(
            "sparse attention is supported for WanTransformer3DModel, not for "
            f"{type(model).__name__}; call patch(..., attention=None) to patch its norms only"
        )
    if norms:
        swap_norms(model, record, precision)


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


def patch(
    target: Any,
    *,
    norms: bool = True,
    attention: Any = None,
    precision: str | None = None,
) -> PatchReport:
    """Patch a diffusers model, or every transformer of a pipeline, in place.

    Args:
        target: a model (``nn.Module``) or a pipeline (its ``transformer*`` components).
        norms: swap norms and, on Wan, fuse each block's modulation chain.
        attention: ``None`` (dense attention as it is) or a
            :class:`ditops.attention.schedule.SparseAttentionConfig` for Wan self-attention.
        precision: ``"exact"``, ``"fast"`` or ``None`` (follow ``DITOPS_PRECISION`` per call).

    Returns what changed (also logged at INFO on the ``ditops`` logger).
    """
    if precision is not None and precision not in PRECISIONS:
        raise PatchError(f"precision must be one of {PRECISIONS} or None, got {precision!r}")
    options = (norms, attention, precision)
    report: dict[str, dict[str, int]] = {}
    for name, model in _models_of(target).items():
        existing: PatchRecord | None = getattr(model, "_ditops_patch", None)
        if existing is not None:
            if existing.options == options:
                report[name] = dict(existing.summary)
                continue
            unpatch(model)
        record = PatchRecord(options)
        try:
            _patch_model(model, norms, attention, precision, record)
        except BaseException:
            _undo(record)
            raise
        model._ditops_patch = record  # type: ignore[assignment]
        report[name] = dict(record.summary)
    result = PatchReport(report)
    logger.info("ditops.patch: %s", result)
    return result


def _undo(record: PatchRecord) -> None:
    for fn in reversed(record.undo):
        fn()
    for parent, name, original in reversed(record.modules):
        setattr(parent, name, original)


def unpatch(target: Any) -> None:
    """Undo :func:`patch`: the original modules and methods come back (a no-op if unpatched)."""
    for model in _models_of(target).values():
        record: PatchRecord | None = getattr(model, "_ditops_patch", None)
        if record is None:
            continue
        _undo(record)
        del model._ditops_patch
