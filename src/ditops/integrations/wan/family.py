"""Patching diffusers' ``WanTransformer3DModel`` (Wan2.1, Wan2.2 A14B / TI2V, I2V) and the
models built of its blocks: ``WanVACETransformer3DModel``, ``SkyReelsV2Transformer3DModel``,
``ChronoEditTransformer3DModel``, ``WanAnimateTransformer3DModel``.

Each ``WanTransformerBlock`` computes, around its three sub-layers (diffusers 0.42)::

    n = (norm1(h.float()) * (1 + scale_msa) + shift_msa).type_as(h)
    h = (h.float() + attn1(n) * gate_msa).type_as(h)
    n = norm2(h.float()).type_as(h)
    h = h + attn2(n, text)
    n = (norm3(h.float()) * (1 + c_scale_msa) + c_shift_msa).type_as(h)
    h = (h.float() + ffn(n).float() * c_gate_msa).type_as(h)

The patched block runs the same expressions on ditops' fused ops, each read once and
rounded once: ``layer_norm_scale_shift`` for the first line, the fused
``scale_residual_layer_norm_scale_shift`` for lines 2-3 and 4-5 (gate 1 for the plain
residual add, which is the same fp32 add rounded once), and ``gated_residual`` for the
last. In exact precision each is bitwise equal to those eager expressions.

Self-attention (``attn1``) gets a processor of ditops'
(:class:`~ditops.integrations.wan.attention.WanSelfAttnProcessor`,
wrapping diffusers' ``WanAttnProcessor``): with the fused blocks, ``norm_q``/``norm_k``
and the rotary embedding run as one ``qk_norm_rope`` op (bitwise in exact precision);
with ``attention=BlockSparseConfig(...)``, ditops'
:class:`~ditops.layers.sparse_attention.BlockSparseAttention` runs on the sparse steps.

The derived models are recognised by what their code does, not by their names: a block
is fused when the fingerprint of its class's forward is one this module has a fused twin
of (``WanTransformerBlock``'s, which ChronoEdit and Wan-Animate copy under the same name;
``WanVACETransformerBlock``'s: input projection, Wan's chain over the control states,
output projection making the hint; ``SkyReelsV2TransformerBlock``'s: Wan's chain with
diffusion forcing's per-frame modulation ``[B, 6, L, C]`` and the causal frame-block mask
handed to self-attention), and a processor is wrapped when its class and the fingerprint
of its ``__call__`` (and of its module's ``_get_qkv_projections``) are known. What the
models add around the blocks (VACE's hint sums, Wan-Animate's face adapters and motion
encoder, SkyReels-V2's fps embedding) runs as diffusers runs it.

Before changing anything, :meth:`WanFamily.check` compares every block and processor
against what this module was written for (types, sub-modules and fingerprints of the
block forwards and processors): a model that does not match is refused whole, with the
reason. Blocks already wrapped by diffusers or
accelerate hooks (caching, offloading, context parallelism) are patched under the hooks.

This module recognises and checks the models (fingerprints, block kinds) and applies the
patch; the fused block forwards are in :mod:`ditops.integrations.wan.blocks`, the
self-attention processors in :mod:`ditops.integrations.wan.attention`.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ditops.integrations.shared.base import (
    AttrSet,
    PatchOptions,
    PatchRecord,
    fingerprint,
    refuse,
    register_like,
)
from ditops.integrations.shared.guard import forward_wrapper_problem, install_guarded
from ditops.integrations.shared.norms import swap_norms
from ditops.integrations.shared.steps import StepState, track_steps
from ditops.integrations.wan.attention import PROCESSORS
from ditops.integrations.wan.blocks import (
    BLOCK_BYPASSES,
    ModulationOps,
    fused_block_forward,
    fused_skyreels_block_forward,
    fused_vace_block_forward,
)

# base.fingerprint of the diffusers versions this module was checked against.
#: ``WanTransformerBlock.forward`` (also the copies ChronoEdit and Wan-Animate define).
KNOWN_BLOCK_FORWARD = {"318f5cac859c98ee": "diffusers 0.42"}
#: ``WanAttnProcessor.__call__``; ChronoEdit's copy differs in comments only; SkyReels-V2's
#: differs where it hands the context-parallel config to cross-attention (a path ditops
#: leaves to it: its self-attention lines are Wan's).
KNOWN_ATTN_PROCESSOR = {
    "860a708317404b68": "diffusers 0.42",
    "967be14b865ec52b": "diffusers 0.42 (ChronoEdit's copy)",
    "d79f607e6be35244": "diffusers 0.42 (SkyReels-V2's copy)",
}
#: ``WanVACETransformerBlock.forward``: proj_in, Wan's chain on the control states, proj_out.
KNOWN_VACE_BLOCK_FORWARD = {"2d4df54a15edd0a2": "diffusers 0.42"}
#: ``SkyReelsV2TransformerBlock.forward``: Wan's chain, per-frame modulation ``[B, 6, L, C]``
#: (diffusion forcing) and the attention mask (causal blocks) handed to self-attention.
KNOWN_SKYREELS_BLOCK_FORWARD = {"bc0ba5d9174f9e38": "diffusers 0.42"}
#: ``_get_qkv_projections`` of transformer_wan (and its copies), which ditops' processor calls.
KNOWN_QKV_PROJECTIONS = {
    "12c562d8104ff115": "diffusers 0.42",
    "ddd1a543e6e3b145": "diffusers 0.42 (SkyReels-V2's copy: its type annotation)",
}

#: The models of this family (diffusers' class names). A model is also taken when its
#: blocks' forward is one ditops knows; either way every block and processor is checked by
#: fingerprint, never by name alone.
MODEL_CLASSES = (
    "WanTransformer3DModel",
    "WanVACETransformer3DModel",
    "SkyReelsV2Transformer3DModel",
    "ChronoEditTransformer3DModel",
    "WanAnimateTransformer3DModel",
)


@dataclass(frozen=True)
class BlockKind:
    """A block forward ditops has a fused twin of: ``fused`` runs the same arithmetic."""

    label: str  # what the class's forward is, in messages
    known: dict[str, str]  # its fingerprints -> the diffusers versions checked
    fused: Any  # the fused forward (module-level, installed through install_guarded)
    kind: str  # counted as "fused <kind>" / "unfused <kind>"


@dataclass
class WanPlan:
    #: (place, block, kind) of every block whose self-attention processor is ditops'.
    blocks: list[tuple[str, nn.Module, BlockKind]] = field(default_factory=list)
    #: place -> why its forward cannot be fused (it runs diffusers' forward).
    unfused: dict[str, str] = field(default_factory=dict)
    #: ditops' processor class for each place (one per diffusers processor class).
    processors: dict[str, type] = field(default_factory=dict)
    #: count steps from the timesteps of calls that bring no step index (Wan's I2V pipeline
    #: and the Wan-derived models' pipelines call the model without one)
    count_steps: bool = False


def _block_kinds() -> tuple[BlockKind, ...]:
    return (
        BlockKind(
            "WanTransformerBlock.forward", KNOWN_BLOCK_FORWARD, fused_block_forward, "blocks"
        ),
        BlockKind(
            "WanVACETransformerBlock.forward",
            KNOWN_VACE_BLOCK_FORWARD,
            fused_vace_block_forward,
            "vace blocks",
        ),
        BlockKind(
            "SkyReelsV2TransformerBlock.forward",
            KNOWN_SKYREELS_BLOCK_FORWARD,
            fused_skyreels_block_forward,
            "blocks",
        ),
    )


def _kind_of(block_cls: type) -> BlockKind | None:
    fp = fingerprint(block_cls.forward)
    return next((k for k in _block_kinds() if fp in k.known), None)


def _iter_blocks(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for name in ("blocks", "vace_blocks"):
        for i, block in enumerate(getattr(model, name, None) or ()):
            yield f"{name}.{i}", block


def _known(versions: dict[str, str]) -> str:
    return ", ".join(dict.fromkeys(versions.values()))


def _processor_problem(proc: Any, where: str) -> tuple[type | None, str | None]:
    """ditops' processor class for diffusers' ``proc`` (by its module and class), or why
    there is none: an unknown class, an unknown ``__call__``, or unknown q/k/v projections."""
    ours = PROCESSORS.get((type(proc).__module__, type(proc).__name__))
    if ours is None:
        return None, (
            f"{where}.processor is a {type(proc).__name__}, not WanAttnProcessor "
            "(or a copy of it ditops knows)"
        )
    fp = fingerprint(type(proc).__call__)
    if fp not in KNOWN_ATTN_PROCESSOR:
        return None, (
            f"{where}.processor {type(proc).__qualname__}.__call__ (fingerprint {fp}) differs "
            f"from the versions ditops knows ({_known(KNOWN_ATTN_PROCESSOR)})"
        )
    fp_qkv = fingerprint(ours.qkv_projections())
    if fp_qkv not in KNOWN_QKV_PROJECTIONS:
        return None, (
            f"{type(proc).__module__}._get_qkv_projections (fingerprint {fp_qkv}) differs from "
            f"the versions ditops knows ({_known(KNOWN_QKV_PROJECTIONS)})"
        )
    return ours, None


def _check(model: nn.Module, options: PatchOptions) -> WanPlan:
    import diffusers

    norms, attention = options.norms, options.attention
    version = getattr(diffusers, "__version__", "?")
    problems: list[str] = []
    processor = norms or attention is not None  # attn1's processor is replaced
    plan = WanPlan(count_steps=True)  # counted only for calls without a step index
    if not any(True for _ in _iter_blocks(model)):
        problems.append("the model has no blocks")
    if (
        attention is not None
        and len(getattr(getattr(model, "config", None), "patch_size", ())) != 3
    ):
        problems.append("sparse attention needs the model's config.patch_size (t, h, w)")
    kinds: dict[type, BlockKind | None] = {}
    for where, block in _iter_blocks(model):
        label = "{}[{}]".format(*where.rsplit(".", 1))  # blocks[3], in messages
        cls = type(block)
        if cls not in kinds:
            kinds[cls] = _kind_of(cls)
        kind = kinds[cls]
        if kind is None:
            fp = fingerprint(cls.forward)
            problems.append(
                f"{label} is a {cls.__name__} whose forward (fingerprint {fp}) is none ditops "
                f"knows of diffusers {version} (WanTransformerBlock's, "
                "WanVACETransformerBlock's, SkyReelsV2TransformerBlock's of "
                f"{_known(KNOWN_BLOCK_FORWARD)})"
            )
            continue
        if norms:
            unfused = forward_wrapper_problem(block, label) or _norm_problem(block)
            if unfused:
                plan.unfused[where] = unfused
        table = getattr(block, "scale_shift_table", None)
        if not isinstance(table, torch.Tensor) or table.dim() != 3 or table.shape[1] != 6:
            problems.append(f"{label}.scale_shift_table is not a [1, 6, C] tensor")
        if processor:
            ours, problem = _processor_problem(
                getattr(block.attn1, "processor", None), f"{label}.attn1"
            )
            if problem:
                problems.append(problem)
            else:
                plan.processors[where] = ours  # type: ignore[assignment]
        if norms:
            problems += _prologue_problems(block.attn1, f"{label}.attn1")
        plan.blocks.append((where, block, kind))
    refuse(model, problems)
    return plan


def _norm_problem(block: nn.Module) -> str | None:
    """Why the fused forward cannot stand in for this block's norms (a norm of the user's,
    or of another kind), or None: such a block runs diffusers' forward."""
    for name in ("norm1", "norm3"):
        norm = getattr(block, name, None)
        if not isinstance(norm, nn.LayerNorm) or norm.elementwise_affine:
            return f"{name} is a {type(norm).__name__}, not a LayerNorm without affine parameters"
    norm2 = getattr(block, "norm2", None)
    if not isinstance(norm2, (nn.LayerNorm, nn.Identity)):
        return f"norm2 is a {type(norm2).__name__}, not a LayerNorm or Identity"
    return None


def _prologue_problems(attn: nn.Module, where: str) -> list[str]:
    """Why the fused prologue cannot stand in for this attention's norm_q / norm_k."""
    width = attn.inner_dim
    problems = []
    for name in ("norm_q", "norm_k"):
        norm = getattr(attn, name, None)
        if not isinstance(norm, nn.RMSNorm) or norm.weight is None:
            problems.append(f"{where}.{name} is not a torch.nn.RMSNorm with a weight")
        elif tuple(norm.normalized_shape) != (width,):
            problems.append(f"{where}.{name} does not normalise across the {attn.heads} heads")
    if not problems and attn.norm_q.eps != attn.norm_k.eps:
        problems.append(f"{where}.norm_q and norm_k have different eps")
    return problems


class WanFamily:
    """diffusers' ``WanTransformer3DModel`` and the models built of its blocks (VACE,
    SkyReels-V2, ChronoEdit, Wan-Animate): fused blocks, optional sparse self-attention."""

    name = "wan"
    #: Declared for the docs' families table (``ditops.docs_tables``) and ``recognise``.
    model_classes = MODEL_CLASSES
    sparse_attention = True

    def recognise(self, model: nn.Module) -> bool:
        """One of :data:`MODEL_CLASSES`, or a model whose first block's forward is one
        ditops knows (a copy under another name); :meth:`check` then fingerprints all."""
        if not isinstance(getattr(model, "blocks", None), nn.ModuleList):
            return False
        if type(model).__name__ in self.model_classes:
            return True
        first = next(iter(model.blocks), None)  # type: ignore[arg-type]
        return first is not None and _kind_of(type(first)) is not None

    def check(self, model: nn.Module, options: PatchOptions) -> WanPlan:
        """Everything the patch relies on, checked before any change. Raises PatchError."""
        return _check(model, options)

    def apply(
        self, model: nn.Module, plan: WanPlan, record: PatchRecord, options: PatchOptions
    ) -> None:
        """Patch a checked Wan model in place, recording every change on ``record``."""
        if options.norms:
            swap_norms(model, record, options.precision)
            ops = ModulationOps(options.precision)
            for where, block, kind in plan.blocks:
                if where in plan.unfused:
                    record.count(f"unfused {kind.kind}")
                    record.unfused[where] = plan.unfused[where]
                    continue
                install_guarded(block, kind.fused, ops, BLOCK_BYPASSES, record, where, kind.kind)
        if options.norms or options.attention is not None:
            self._attention(model, plan, record, options)

    def _attention(
        self, model: nn.Module, plan: WanPlan, record: PatchRecord, options: PatchOptions
    ) -> None:
        """Self-attention: the fused prologue with the fused blocks, sparsity if asked."""
        steps = None
        if options.attention is not None:
            steps = StepState(count_steps=plan.count_steps)
            steps.patch_size = tuple(model.config.patch_size)  # type: ignore[attr-defined]
            track_steps(model, steps, record)
        for cls in set(plan.processors.values()):
            module, name = cls.wraps
            register_like(cls, getattr(importlib.import_module(module), name))
        for where, block, _kind in plan.blocks:
            sparse = prologue = None
            if options.attention is not None:
                from ditops.layers.sparse_attention import BlockSparseAttention

                sparse = BlockSparseAttention(options.attention)
                record.count("sparse self-attentions")
            if options.norms:
                from ditops.ops.qk_norm_rope import QKNormRopeOp

                prologue = QKNormRopeOp()
                prologue.precision = options.precision
                record.count("fused attention prologues")
            processor = plan.processors[where](block.attn1.processor, steps, sparse, prologue)
            record.add(AttrSet.apply(block.attn1, "processor", processor))
