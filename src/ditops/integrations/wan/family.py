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

Before changing anything, the skeleton's check compares every block and processor
against what this module declares (:data:`SPEC`) (types, sub-modules and fingerprints of the
block forwards and processors): a model that does not match is refused whole, with the
reason. Blocks already wrapped by diffusers or
accelerate hooks (caching, offloading, context parallelism) are patched under the hooks.

This module declares the family (block kinds by fingerprint, checks); the fused block
forwards are in :mod:`ditops.integrations.wan.blocks`, the self-attention processors in
:mod:`ditops.integrations.wan.attention`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ditops.integrations.shared.family import Attention, Blocks, FamilySpec, Fused, Relied, Sparse
from ditops.integrations.shared.fingerprint_table import Seen
from ditops.integrations.shared.fingerprints import known
from ditops.integrations.wan.attention import PROCESSORS
from ditops.integrations.wan.blocks import (
    BLOCK_BYPASSES,
    WanOps,
    fused_block_forward,
    fused_skyreels_block_forward,
    fused_vace_block_forward,
)

# The fingerprints of the diffusers functions reproduced: ``fingerprints.known``.
#: ``WanTransformerBlock.forward`` (also the copies ChronoEdit and Wan-Animate define).
KNOWN_BLOCK_FORWARD = known("WanTransformerBlock.forward")
#: ``WanAttnProcessor.__call__`` and its copies (ChronoEdit's, Wan-Animate's, SkyReels-V2's,
#: which differs where it hands the context-parallel config to cross-attention: a path
#: ditops leaves to it, its self-attention lines are Wan's).
KNOWN_ATTN_PROCESSOR = known("WanAttnProcessor.__call__")
#: ``WanVACETransformerBlock.forward``: proj_in, Wan's chain on the control states, proj_out.
KNOWN_VACE_BLOCK_FORWARD = known("WanVACETransformerBlock.forward")
#: ``SkyReelsV2TransformerBlock.forward``: Wan's chain, per-frame modulation ``[B, 6, L, C]``
#: (diffusion forcing) and the attention mask (causal blocks) handed to self-attention.
KNOWN_SKYREELS_BLOCK_FORWARD = known("SkyReelsV2TransformerBlock.forward")
#: ``_get_qkv_projections`` of transformer_wan (and its copies), which ditops' processor calls.
KNOWN_QKV_PROJECTIONS = known("_get_qkv_projections")

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


def _table_problems(block: nn.Module, where: str) -> list[str]:
    table = getattr(block, "scale_shift_table", None)
    if not isinstance(table, torch.Tensor) or table.dim() != 3 or table.shape[1] != 6:
        return [f"{where}.scale_shift_table is not a [1, 6, C] tensor"]
    return []


def _norm_unfused(block: nn.Module, where: str) -> list[str]:
    """Why the fused forward cannot stand in for this block's norms (a norm of the user's,
    or of another kind): such a block runs diffusers' forward."""
    for name in ("norm1", "norm3"):
        norm = getattr(block, name, None)
        if not isinstance(norm, nn.LayerNorm) or norm.elementwise_affine:
            what = type(norm).__name__
            return [f"{name} is a {what}, not a LayerNorm without affine parameters"]
    norm2 = getattr(block, "norm2", None)
    if not isinstance(norm2, (nn.LayerNorm, nn.Identity)):
        return [f"norm2 is a {type(norm2).__name__}, not a LayerNorm or Identity"]
    return []


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


def _qkv_projections(processor: type) -> Relied:
    return {"_get_qkv_projections": (processor.qkv_projections(), KNOWN_QKV_PROJECTIONS)}


def _patch_size(model: nn.Module) -> tuple[int, ...] | None:
    size = tuple(getattr(getattr(model, "config", None), "patch_size", ()) or ())
    return size if len(size) == 3 else None


def _kind(label: str, table: Mapping[str, Seen], forward: object, kind: str = "blocks") -> Fused:
    return Fused(
        label, table, forward, BLOCK_BYPASSES, problems=_table_problems,  # type: ignore[arg-type]
        unfused=_norm_unfused, attention="attn1", prologue=_prologue_problems, kind=kind,
    )  # fmt: skip


SPEC = FamilySpec(
    name="wan",
    model_classes=MODEL_CLASSES,
    summary="fused blocks, optional sparse self-attention",
    blocks=(
        Blocks(
            ("blocks", "vace_blocks"),
            (
                _kind("WanTransformerBlock.forward", KNOWN_BLOCK_FORWARD, fused_block_forward),
                _kind(
                    "WanVACETransformerBlock.forward",
                    KNOWN_VACE_BLOCK_FORWARD,
                    fused_vace_block_forward,
                    "vace blocks",
                ),
                _kind(
                    "SkyReelsV2TransformerBlock.forward",
                    KNOWN_SKYREELS_BLOCK_FORWARD,
                    fused_skyreels_block_forward,
                ),
            ),  # fmt: skip
            required=True,
        ),
    ),
    ops=WanOps.of,
    attention=Attention(PROCESSORS, KNOWN_ATTN_PROCESSOR, relied=_qkv_projections),
    # Wan's I2V pipeline and the Wan-derived models' pipelines call the model without a
    # step index: counted from the timesteps then.
    sparse=Sparse(patch_size=_patch_size, count_steps=True),
    swap_norms=True,
    by_blocks=True,
)
