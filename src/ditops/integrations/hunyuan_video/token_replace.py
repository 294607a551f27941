"""HunyuanVideo I2V's ``token_replace`` blocks on ditops' adaLN ops.

With ``image_condition_type="token_replace"`` (diffusers 0.42) the first frame's
``num_tokens`` video tokens (the image's) are modulated and gated by a second embedding
(``token_replace_emb``, the conditioning at timestep 0), the other tokens by ``temb``::

    n = norm(h);  n = cat([n[:, :T0] * (1 + tr_scale) + tr_shift, n[:, T0:] * (1 + scale) + shift])
    h = cat([h[:, :T0] + a[:, :T0] * tr_gate, h[:, T0:] + a[:, T0:] * gate])

(the single-stream block gates ``proj_out``'s output before adding the residual; the text
stream of the double-stream block is HunyuanVideo's). A layer norm normalises each token
on its own, so the fused forwards run each op on the two row ranges and concatenate, as
diffusers does: the same bits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ditops.integrations.hunyuan_video.attention import single_stream_branches
from ditops.integrations.hunyuan_video.forwards import joint_attention, text_mlp_half
from ditops.integrations.shared.adaln_zero import AdaLNOps
from ditops.integrations.shared.fingerprints import relied


def _embs(norm: nn.Module, temb: torch.Tensor, tr_emb: torch.Tensor, chunks: int) -> tuple:
    # HunyuanVideoTokenReplaceAdaLayerNormZero(Single): both projections, the same ops.
    emb = norm.linear(norm.silu(temb)).chunk(chunks, dim=1)
    tr = norm.linear(norm.silu(tr_emb)).chunk(chunks, dim=1)
    return emb, tr


def _split(
    op: Callable[..., Any],
    n: int,
    rows: tuple[torch.Tensor, ...],
    mods: tuple[tuple[torch.Tensor, torch.Tensor], ...],
    *extra: Any,
) -> Any:
    """``op`` on rows ``[:n]`` of ``rows`` with the first of each modulation pair (the
    token-replace one), on rows ``[n:]`` with the second, the results concatenated."""
    parts = [
        op(*(t[:, r] for t in rows), *(m[i] for m in mods), *extra)
        for i, r in enumerate((slice(None, n), slice(n, None)))
    ]
    if isinstance(parts[0], tuple):
        return tuple(torch.cat([a, b], dim=1) for a, b in zip(*parts))
    return torch.cat(parts, dim=1)


def token_replace_double_forward(
    block: nn.Module,
    ops: AdaLNOps,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    freqs_cis: tuple[torch.Tensor, torch.Tensor] | None = None,
    token_replace_emb: torch.Tensor | None = None,
    num_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``HunyuanVideoTokenReplaceTransformerBlock.forward`` on ditops' ops."""
    (shift, scale, gate, shift_mlp, scale_mlp, gate_mlp), tr = _embs(
        block.norm1, temb, token_replace_emb, 6
    )
    tr_shift, tr_scale, tr_gate, tr_shift_mlp, tr_scale_mlp, tr_gate_mlp = tr
    n0 = num_tokens
    eps1 = block.norm1.norm.eps
    n = _split(
        ops.modulate,
        n0,
        (hidden_states,),
        ((tr_scale[:, None], scale[:, None]), (tr_shift[:, None], shift[:, None])),
        eps1,
    )
    attn_output, text = joint_attention(
        block, ops, n, encoder_hidden_states, temb, attention_mask, freqs_cis
    )
    n, hidden_states = _split(
        ops.residual_modulate,
        n0,
        (hidden_states, attn_output),
        (
            (tr_gate.unsqueeze(1), gate.unsqueeze(1)),
            (tr_scale_mlp[:, None], scale_mlp[:, None]),
            (tr_shift_mlp[:, None], shift_mlp[:, None]),
        ),
        block.norm2.eps,
    )
    ff = block.ff(n)
    hidden_states = _split(
        ops.residual, n0, (hidden_states, ff), ((tr_gate_mlp.unsqueeze(1), gate_mlp.unsqueeze(1)),)
    )
    return hidden_states, text_mlp_half(block, ops, encoder_hidden_states, *text)


def token_replace_single_forward(
    block: nn.Module,
    ops: AdaLNOps,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    token_replace_emb: torch.Tensor | None = None,
    num_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``HunyuanVideoTokenReplaceSingleTransformerBlock.forward`` on ditops' ops."""
    text = encoder_hidden_states.shape[1]
    residual = torch.cat([hidden_states, encoder_hidden_states], dim=1)
    (shift, scale, gate), (tr_shift, tr_scale, tr_gate) = _embs(
        block.norm, temb, token_replace_emb, 3
    )
    n = _split(
        ops.modulate,
        num_tokens,
        (residual,),
        ((tr_scale[:, None], scale[:, None]), (tr_shift[:, None], shift[:, None])),
        block.norm.norm.eps,
    )
    out = single_stream_branches(block, n, text, attention_mask, image_rotary_emb)
    hidden_states = _split(
        ops.residual, num_tokens, (residual, out), ((tr_gate.unsqueeze(1), gate.unsqueeze(1)),)
    )
    return hidden_states[:, :-text], hidden_states[:, -text:]


def relied_on() -> dict[str, tuple[Callable[..., Any], dict[str, str]]]:
    """The token-replace norms whose arithmetic these reproduce, with the fingerprints
    checked against (the blocks' own forwards are the family's block kinds)."""
    from diffusers.models.transformers import transformer_hunyuan_video as hv

    return relied(
        hv,
        "HunyuanVideoTokenReplaceAdaLayerNormZero.forward",
        "HunyuanVideoTokenReplaceAdaLayerNormZeroSingle.forward",
    )


def norm_problems(block: nn.Module, where: str, double: bool) -> list[str]:
    """The token-replace block's norms: the token-replace adaLN over a LayerNorm without
    affine (not its fp32 variant); the double block's text stream as HunyuanVideo's."""
    from diffusers.models import normalization
    from diffusers.models.transformers import transformer_hunyuan_video as hv

    def plain(m: object) -> bool:
        return type(m) is nn.LayerNorm and not m.elementwise_affine  # type: ignore[union-attr]

    expected: dict[str, type] = {"norm": hv.HunyuanVideoTokenReplaceAdaLayerNormZeroSingle}
    if double:
        expected = {
            "norm1": hv.HunyuanVideoTokenReplaceAdaLayerNormZero,
            "norm1_context": normalization.AdaLayerNormZero,
        }
    problems = []
    for name, cls in expected.items():
        norm = getattr(block, name, None)
        if type(norm) is not cls or not plain(norm.norm) or getattr(norm, "emb", None):
            problems.append(
                f"{where}.{name} is not a {cls.__name__} over a LayerNorm without affine"
            )
    for name in ("norm2", "norm2_context") if double else ():
        if not plain(getattr(block, name, None)):
            problems.append(f"{where}.{name} is not a LayerNorm without affine parameters")
    return problems
