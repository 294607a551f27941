"""The fused forwards of a patched Z-Image model: the single-stream block and the final
layer on ditops' ops (``rms`` in diffusers' arithmetic, ``residual``, ``modulate``; one
bundle per patched model) and :class:`FusedZImageAttnProcessor`, Z-Image's attention
with the prologue on ``qk_norm_rope``. The arithmetic they reproduce is written out in
:mod:`ditops.integrations.z_image.family`, which checks a model and installs these.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ditops.integrations.shared.adaln_zero import AdaLNOps
from ditops.integrations.shared.complex_rope import ComplexRopeProcessor
from ditops.integrations.shared.guard import Bypass

#: The block's sandwich norms, which the fused forward computes without calling them.
BLOCK_BYPASSES = ("attention_norm1", "attention_norm2", "ffn_norm1", "ffn_norm2")
FINAL_BYPASSES = ("norm_final",)

#: (scale_msa, gate_msa, scale_mlp, gate_mlp), None each for a block without modulation.
Mods = tuple[torch.Tensor | None, ...]


def _mods(
    block: nn.Module,
    seq_len: int,
    adaln_input: torch.Tensor | None,
    noise_mask: torch.Tensor | None,
    adaln_noisy: torch.Tensor | None,
    adaln_clean: torch.Tensor | None,
) -> Mods:
    """``ZImageTransformerBlock.forward``'s modulations, the same operations: ``1 +
    scale`` and ``tanh(gate)``, ``[B, 1, D]``, or per token (``noise_mask``) ``[B, L, D]``."""
    if not block.modulation:
        return None, None, None, None
    if noise_mask is None:
        mod = block.adaLN_modulation(adaln_input)
        scale_msa, gate_msa, scale_mlp, gate_mlp = mod.unsqueeze(1).chunk(4, dim=2)
        return 1.0 + scale_msa, gate_msa.tanh(), 1.0 + scale_mlp, gate_mlp.tanh()
    from diffusers.models.transformers.transformer_z_image import select_per_token

    noisy = block.adaLN_modulation(adaln_noisy).chunk(4, dim=1)
    clean = block.adaLN_modulation(adaln_clean).chunk(4, dim=1)

    def pick(i: int) -> torch.Tensor:
        a, b = noisy[i], clean[i]
        a, b = (a.tanh(), b.tanh()) if i % 2 else (1.0 + a, 1.0 + b)
        return select_per_token(a, b, noise_mask, seq_len)

    return pick(0), pick(1), pick(2), pick(3)


def _rms(ops: AdaLNOps, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """diffusers' ``RMSNorm`` (a weight, no bias) on the op."""
    return ops.rms(x, norm.weight, norm.eps, "diffusers")


def _scaled(
    ops: AdaLNOps, norm: nn.Module, x: torch.Tensor, scale: torch.Tensor | None
) -> torch.Tensor:
    """``norm(x) * scale`` (``norm(x)`` without a scale) on the ``rms_norm_scale`` op: the
    norm rounded to the weight's dtype, times the weight, times the scale, as eager."""
    if scale is None:
        return _rms(ops, norm, x)
    return ops.rms_scale(x, scale, norm.eps, weight=norm.weight)  # type: ignore[no-any-return]


def block_forward(
    block: nn.Module,
    ops: AdaLNOps,
    x: torch.Tensor,
    attn_mask: torch.Tensor | None,
    freqs_cis: torch.Tensor,
    adaln_input: torch.Tensor | None = None,
    noise_mask: torch.Tensor | None = None,
    adaln_noisy: torch.Tensor | None = None,
    adaln_clean: torch.Tensor | None = None,
) -> torch.Tensor:
    """``ZImageTransformerBlock.forward`` on ditops' ops (see
    :mod:`ditops.integrations.z_image.family`).

    Installed through :func:`~ditops.integrations.shared.guard.install_guarded`: it runs only
    while nothing is attached to the norms it bypasses (:data:`BLOCK_BYPASSES`). Exact
    precision off the CPU runs diffusers' forward: on an NPU diffusers' RMSNorm calls
    ``npu_rms_norm``, which the op's meaning is not; elsewhere the ops would run their
    meaning, diffusers' own expressions, so nothing is gained.
    """
    if x.device.type != "cpu" and ops.rms.resolved_precision() == "exact":
        # (diffusers 0.36's forward takes no per-token arguments: passed only when used)
        per_token = () if noise_mask is None else (noise_mask, adaln_noisy, adaln_clean)
        return type(block).forward(block, x, attn_mask, freqs_cis, adaln_input, *per_token)
    scale_msa, gate_msa, scale_mlp, gate_mlp = _mods(
        block, x.shape[1], adaln_input, noise_mask, adaln_noisy, adaln_clean
    )
    attn_out = block.attention(
        _scaled(ops, block.attention_norm1, x, scale_msa),
        attention_mask=attn_mask,
        freqs_cis=freqs_cis,
    )
    x = ops.residual(x, _rms(ops, block.attention_norm2, attn_out), gate_msa)
    ff = block.feed_forward(_scaled(ops, block.ffn_norm1, x, scale_mlp))
    return ops.residual(x, _rms(ops, block.ffn_norm2, ff), gate_mlp)


def final_forward(
    layer: nn.Module,
    ops: AdaLNOps,
    x: torch.Tensor,
    c: torch.Tensor | None = None,
    noise_mask: torch.Tensor | None = None,
    c_noisy: torch.Tensor | None = None,
    c_clean: torch.Tensor | None = None,
) -> torch.Tensor:
    """``FinalLayer.forward`` with its modulated norm on ``adaln_modulate`` (which adds
    the 1 to the scale, in the dtype, as ``1.0 + scale`` does; selecting per token before
    or after adding it picks the same values)."""
    if noise_mask is not None:
        from diffusers.models.transformers.transformer_z_image import select_per_token

        mod = layer.adaLN_modulation
        scale = select_per_token(mod(c_noisy), mod(c_clean), noise_mask, x.shape[1])
    else:
        if c is None:
            raise ValueError("FinalLayer: either c or (c_noisy, c_clean) must be given")
        scale = layer.adaLN_modulation(c).unsqueeze(1)
    return layer.linear(ops.modulate(x, scale, None, layer.norm_final.eps))


def qk_bypass() -> Bypass:
    """The q/k norms as the fused prologue finds them: diffusers' RMSNorms, no hooks."""
    from diffusers.models.normalization import RMSNorm

    return Bypass((("norm_q", RMSNorm), ("norm_k", RMSNorm)))


class FusedZImageAttnProcessor(ComplexRopeProcessor):
    """diffusers' ``ZSingleStreamAttnProcessor`` with the attention prologue (the RMSNorms
    of q and k per head, then the complex rotation) on ditops' ``qk_norm_rope``; everything
    else is Z-Image's code path (see :mod:`ditops.integrations.z_image.family`).

    A call it was not written for runs the original processor: no ops, no rotary table or
    one other than the model's complex ``[B, L, D/2]``, q/k norms hooked or replaced since
    the patch, or exact precision off the CPU (see
    :mod:`~ditops.integrations.shared.complex_rope`).
    """

    wraps = ("diffusers.models.transformers.transformer_z_image", "ZSingleStreamAttnProcessor")

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        freqs_cis: torch.Tensor | None = None,
    ) -> Any:
        tables = self.tables(hidden_states, freqs_cis, 3)
        if tables is None or qk_bypass().problem(attn) is not None:
            return self.original(
                attn, hidden_states, encoder_hidden_states, attention_mask, freqs_cis
            )
        query, key, value = (
            p(hidden_states).unflatten(-1, (attn.heads, -1))
            for p in (attn.to_q, attn.to_k, attn.to_v)
        )
        nq, nk = attn.norm_q, attn.norm_k
        cos, sin = tables
        query, key = self.ops.qk(  # type: ignore[union-attr]
            query, key, nq.weight, nk.weight, cos, sin, nq.eps, convention="diffusers"
        )
        if attention_mask is not None and attention_mask.ndim == 2:
            attention_mask = attention_mask[:, None, None, :]
        out = self._dispatch_dense(query, key, value, attention_mask)
        out = attn.to_out[0](out.flatten(2, 3).to(query.dtype))
        if len(attn.to_out) > 1:  # dropout
            out = attn.to_out[1](out)
        return out
