"""The adaLN-Zero pieces that FLUX's and HunyuanVideo's fused blocks share.

Both families' double-stream blocks (``FluxTransformerBlock``,
``HunyuanVideoTransformerBlock`` and its token-replace and 1.5 kin) project the
conditioning with ``AdaLayerNormZero`` (``linear(silu(temb))``, six chunks: shift, scale,
gate, shift_mlp, scale_mlp, gate_mlp), modulate each stream's layer norm with the first
two, and finish each stream the same way: ``h + attn * gate``, ``norm2``, modulated by the
MLP's pair, ``h + ff * gate_mlp``. :class:`AdaLNOps` holds one patched model's ops; the
functions run those steps on them, in the model dtype, the same operations as diffusers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

DIFFUSERS_042 = "diffusers 0.42"


def relied_on_norms() -> dict[str, tuple[Callable[..., Any], dict[str, str]]]:
    """The adaLN-Zero norms FLUX and HunyuanVideo share, whose arithmetic the fused blocks
    reproduce, with the fingerprints of the versions checked (see each family's
    ``relied_on``)."""
    from diffusers.models import normalization

    return {
        "AdaLayerNormZero.forward": (
            normalization.AdaLayerNormZero.forward, {"690b44401a6e9d64": DIFFUSERS_042}
        ),
        "AdaLayerNormZeroSingle.forward": (
            normalization.AdaLayerNormZeroSingle.forward, {"ff138e112a4f4ff9": DIFFUSERS_042}
        ),
        "AdaLayerNormContinuous.forward": (
            normalization.AdaLayerNormContinuous.forward, {"6774475aefc7c86f": DIFFUSERS_042}
        ),
    }  # fmt: skip


class AdaLNOps:
    """One set of op instances per patched model, carrying its precision (a plain object:
    it deep-copies and pickles with the model)."""

    def __init__(self, precision: str | None) -> None:
        from ditops.ops import modulation_model_dtype as adaln
        from ditops.ops import qk_norm_rope

        self.modulate = adaln.AdaLNModulateOp()
        self.residual = adaln.AdaLNResidualOp()
        self.residual_modulate = adaln.AdaLNResidualModulateOp()
        self.qk = qk_norm_rope.QKNormRopeOp()
        for op in (self.modulate, self.residual, self.residual_modulate, self.qk):
            op.precision = precision


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
