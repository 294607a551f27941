"""The fused forwards of Wan's blocks: ``WanTransformerBlock``'s (also ChronoEdit's and
Wan-Animate's copies), ``WanVACETransformerBlock``'s and ``SkyReelsV2TransformerBlock``'s.

Each runs the block's norm / modulation / residual chain (written out in
:mod:`ditops.integrations.wan.family`) on ditops' fused ops, one :class:`WanOps` per
patched model; :class:`~ditops.integrations.wan.family.WanFamily` installs them through
:func:`~ditops.integrations.shared.guard.install_guarded`, which runs diffusers' forward
instead while anything is attached to the norms they bypass (:data:`BLOCK_BYPASSES`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ditops.integrations.shared.ops import QKOps
from ditops.ops.modulation_fp32 import (
    GatedResidualOp,
    LayerNormScaleShiftOp,
    ScaleResidualLayerNormScaleShiftOp,
)

#: What the fused block computes without calling it (see :class:`~.guard.Bypass`).
BLOCK_BYPASSES = ("norm1", "norm2", "norm3")


@dataclass(eq=False)
class WanOps(QKOps):
    """The ops of one patched Wan model: the fp32 modulation chain (``ln_mod``, ``fused``:
    the residual, norm and modulation at once, ``gated``) and the q/k prologue ``qk``."""

    ln_mod: LayerNormScaleShiftOp
    fused: ScaleResidualLayerNormScaleShiftOp
    gated: GatedResidualOp


def _modulations(block: nn.Module, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # The same arithmetic as diffusers (an fp32 sum), so exact mode stays bitwise.
    if temb.ndim == 4:  # [B, L, 6, C]: one modulation per token (Wan2.2 TI2V)
        chunks = (block.scale_shift_table.unsqueeze(0) + temb.float()).chunk(6, dim=2)
        return tuple(c.squeeze(2) for c in chunks)
    return (block.scale_shift_table + temb.float()).chunk(6, dim=1)


def _fused_chain(
    block: nn.Module,
    ops: WanOps,
    h: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    modulations: tuple[torch.Tensor, ...],
    rotary_emb: Any,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Wan's norm / modulation / residual chain around attn1, attn2 and ffn, fused."""
    norm2 = block.norm2
    shift, scale, gate, c_shift, c_scale, c_gate = modulations
    n = ops.ln_mod(h, None, None, scale, shift, block.norm1.eps)
    attn = block.attn1(n, None, attention_mask, rotary_emb)
    if isinstance(norm2, nn.LayerNorm):
        n, h = ops.fused(h, attn, gate, norm2.weight, norm2.bias, None, None, norm2.eps)
    else:  # cross_attn_norm=False: norm2 is Identity, so n is the new residual itself
        h = ops.gated(h, attn, gate)
        n = h
    attn = block.attn2(n, encoder_hidden_states, None, None)
    n, h = ops.fused(h, attn, 1, None, None, c_scale, c_shift, block.norm3.eps)
    ff = block.ffn(n)
    return ops.gated(h, ff, c_gate)


def fused_block_forward(
    block: nn.Module,
    ops: WanOps,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    rotary_emb: torch.Tensor,
) -> torch.Tensor:
    """``WanTransformerBlock.forward`` on the fused ops (see :mod:`ditops.integrations.wan.family`).

    Installed through :func:`~ditops.integrations.shared.guard.install_guarded`: it runs only
    while nothing is attached to the norms it bypasses (:data:`BLOCK_BYPASSES`).
    """
    mods = _modulations(block, temb)
    return _fused_chain(block, ops, hidden_states, encoder_hidden_states, mods, rotary_emb)


def fused_vace_block_forward(
    block: nn.Module,
    ops: WanOps,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    control_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    rotary_emb: torch.Tensor,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``WanVACETransformerBlock.forward``: the input projection (block 0: the control
    states plus the video's), Wan's chain on the fused ops over the control states, the
    output projection (the hint). Returns ``(hint, control states)``, as diffusers."""
    control = control_hidden_states
    if block.proj_in is not None:
        control = block.proj_in(control)
        control = control + hidden_states
    mods = (block.scale_shift_table.to(temb.device) + temb.float()).chunk(6, dim=1)
    control = _fused_chain(block, ops, control, encoder_hidden_states, mods, rotary_emb)
    hint = block.proj_out(control) if block.proj_out is not None else None
    return hint, control


def fused_skyreels_block_forward(
    block: nn.Module,
    ops: WanOps,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    rotary_emb: torch.Tensor,
    attention_mask: torch.Tensor,
) -> torch.Tensor:
    """``SkyReelsV2TransformerBlock.forward``: Wan's chain, with diffusion forcing's
    per-frame modulation (``temb`` ``[B, 6, L, C]``: one per token, the same fp32 sum) and
    the attention mask (causal frame blocks) handed to self-attention."""
    if temb.dim() == 3:
        mods = (block.scale_shift_table + temb.float()).chunk(6, dim=1)
    elif temb.dim() == 4:
        e = (block.scale_shift_table.unsqueeze(2) + temb.float()).chunk(6, dim=1)
        mods = tuple(ei.squeeze(1) for ei in e)
    else:
        raise ValueError(f"SkyReelsV2TransformerBlock: temb must be 3-D or 4-D, got {temb.dim()}-D")
    return _fused_chain(
        block, ops, hidden_states, encoder_hidden_states, mods, rotary_emb, attention_mask
    )
