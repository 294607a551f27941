"""The adaLN-Zero pieces that FLUX's and HunyuanVideo's fused blocks share.

Both families' double-stream blocks (``FluxTransformerBlock``,
``HunyuanVideoTransformerBlock`` and its token-replace and 1.5 kin) project the
conditioning with ``AdaLayerNormZero`` (``linear(silu(temb))``, six chunks: shift, scale,
gate, shift_mlp, scale_mlp, gate_mlp), modulate each stream's layer norm with the first
two, and finish each stream the same way: ``h + attn * gate``, ``norm2``, modulated by the
MLP's pair, ``h + ff * gate_mlp``. ``AdaLNOps.of`` makes one patched model's ops; the
functions run those steps on them, in the model dtype, the same operations as diffusers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ditops.integrations.shared.base import is_plain_layer_norm
from ditops.integrations.shared.family import Blocks, Fused
from ditops.integrations.shared.fingerprints import known, relied
from ditops.integrations.shared.ops import QKOps
from ditops.ops.modulation_model_dtype import (
    AdaLNModulateOp,
    AdaLNResidualModulateOp,
    AdaLNResidualOp,
)
from ditops.ops.qk_norm_rope import RMSNormOp

DIFFUSERS_042 = "diffusers 0.42"

#: What an adaLN-Zero double-stream block's fused forward computes without calling it
#: (see :class:`~ditops.integrations.shared.guard.Bypass`): FLUX's, Chroma's,
#: HunyuanVideo's, SD3's joint block's.
DOUBLE_BYPASSES = (
    "norm1",
    "norm1.norm",
    "norm1_context",
    "norm1_context.norm",
    "norm2",
    "norm2_context",
)
#: The same for a single-stream block (FLUX's, Chroma's, HunyuanVideo's).
SINGLE_BYPASSES = ("norm", "norm.norm")


def relied_on_norms() -> dict[str, tuple[Callable[..., Any], dict[str, str]]]:
    """The adaLN-Zero norms FLUX and HunyuanVideo share, whose arithmetic the fused blocks
    reproduce, with the fingerprints of the versions checked (see each family's
    ``relied_on``)."""
    from diffusers.models import normalization

    return relied(
        normalization,
        "AdaLayerNormZero.forward",
        "AdaLayerNormZeroSingle.forward",
        "AdaLayerNormContinuous.forward",
    )


@dataclass(eq=False)
class AdaLNOps(QKOps):
    """The ops of one patched adaLN-Zero model (FLUX, HunyuanVideo and kin): the norms
    without affine, the gated residual and both at once, the q/k prologue ``qk``, and
    ``rms`` (an RMSNorm for rows that are normed but not rotated)."""

    modulate: AdaLNModulateOp
    residual: AdaLNResidualOp
    residual_modulate: AdaLNResidualModulateOp
    rms: RMSNormOp


def ada_emb(norm: nn.Module, temb: torch.Tensor, chunks: int) -> tuple[torch.Tensor, ...]:
    """AdaLayerNormZero(Single)'s projection of the conditioning, the same operations."""
    return norm.linear(norm.silu(temb)).chunk(chunks, dim=1)


def ada_modulate(
    ops: AdaLNOps, norm: nn.Module, x: torch.Tensor, temb: torch.Tensor, chunks: int
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """``norm(x, temb)`` (an AdaLayerNormZero with ``chunks`` 6, Single with 3) on the
    modulate op: ``x`` normed and modulated by the projection's scale and shift, and the
    projection's chunks."""
    emb = ada_emb(norm, temb, chunks)
    shift, scale = emb[0], emb[1]
    return ops.modulate(x, scale[:, None], shift[:, None], norm.norm.eps), emb


def mlp_half(
    ops: AdaLNOps,
    h: torch.Tensor,
    attn_output: torch.Tensor,
    emb: tuple[torch.Tensor, ...],
    norm2: nn.Module,
    ff: Any,
) -> torch.Tensor:
    """The rest of one stream of a double-stream block, given its attention output and
    its six chunks ``emb``: ``h + attn * gate``, ``norm2`` modulated by the MLP's pair,
    ``h + ff(n) * gate_mlp``."""
    _, _, gate, shift_mlp, scale_mlp, gate_mlp = emb
    n, h = ops.residual_modulate(
        h, attn_output, gate.unsqueeze(1), scale_mlp[:, None], shift_mlp[:, None], norm2.eps
    )
    return ops.residual(h, ff(n), gate_mlp.unsqueeze(1))


def zero_norm_problem(block: nn.Module, name: str, single: bool) -> str | None:
    """Why ``block.<name>`` is not an AdaLayerNormZero (``single``: ...Single) over a
    LayerNorm without affine, the norm the fused forwards compute, or None."""
    from diffusers.models import normalization

    cls = normalization.AdaLayerNormZeroSingle if single else normalization.AdaLayerNormZero
    norm = getattr(block, name, None)
    if type(norm) is not cls or getattr(norm, "emb", None) is not None:
        return f"{name} is not an {cls.__name__} over a LayerNorm without affine"
    if not is_plain_layer_norm(norm.norm):
        return f"{name} is not an {cls.__name__} over a LayerNorm without affine"
    return None


def norm_out_problems(norm: nn.Module, where: str) -> list[str]:
    """The output norm ``norm_out_forward`` computes: an AdaLayerNormContinuous over a
    LayerNorm without affine."""
    if not is_plain_layer_norm(getattr(norm, "norm", None)):
        return [f"{where} is not an AdaLayerNormContinuous over a LayerNorm without affine"]
    return []


def norm_out_forward(
    norm: nn.Module, ops: AdaLNOps, x: torch.Tensor, conditioning_embedding: torch.Tensor
) -> torch.Tensor:
    """``AdaLayerNormContinuous.forward`` (layer norm without affine) on ditops' op."""
    emb = norm.linear(norm.silu(conditioning_embedding).to(x.dtype))
    scale, shift = torch.chunk(emb, 2, dim=1)
    return ops.modulate(x, scale[:, None, :], shift[:, None, :], norm.norm.eps)


def norm_out_blocks() -> Blocks:
    """The output norm of FLUX, FLUX.2 and Mochi, declared (``FamilySpec.blocks``):
    ``norm_out``, an ``AdaLayerNormContinuous`` over a LayerNorm without affine, on the
    modulate op (:func:`norm_out_forward`)."""
    label = "AdaLayerNormContinuous.forward"
    fused = Fused(label, known(label), norm_out_forward, ("norm",),
                  problems=norm_out_problems, kind="output norm")  # fmt: skip
    return Blocks(("norm_out",), (fused,), required=True)
