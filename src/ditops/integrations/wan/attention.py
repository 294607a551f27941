"""Wan's self-attention processor (:class:`WanSelfAttnProcessor`, one subclass per copy
of diffusers' ``WanAttnProcessor`` it wraps): the fused q/k norm and rotary prologue and
the optional block-sparse attention, dense and sparse steps, under diffusers' context
parallelism too. :class:`~ditops.integrations.wan.family.WanFamily` checks the processors it
replaces (:data:`PROCESSORS`) and installs these.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

import torch
from torch import nn

from ditops.integrations.shared.guard import Bypass, float64_call
from ditops.integrations.shared.ops import QKOps
from ditops.integrations.shared.parallel import (
    attend_across_ranks,
    check_method_per_rank,
    context_parallel_of,
)
from ditops.integrations.shared.processors import WrappingProcessor
from ditops.integrations.shared.steps import StepState, runs_dense

logger = logging.getLogger("ditops")


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # WanAttnProcessor's rotary embedding (interleaved pairs), the same operations.
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    c = cos[..., 0::2]
    s = sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * c - x2 * s
    out[..., 1::2] = x1 * s + x2 * c
    return out.type_as(x)


#: The q/k norms the fused prologue computes without calling them.
PROLOGUE_BYPASS = Bypass((("norm_q", nn.RMSNorm), ("norm_k", nn.RMSNorm)))


class WanSelfAttnProcessor(WrappingProcessor):
    """Wan self-attention (``attn1``) with ditops' prologue and optional block sparsity.

    ``ops`` (the patched model's op bundle, with the fused blocks): its ``qk`` op runs
    the RMSNorm of q and k across heads and the rotary embedding as one op, on dense and
    sparse steps; in exact precision bitwise what ``WanAttnProcessor`` computes. ``sparse`` (a
    :class:`~ditops.layers.sparse_attention.BlockSparseAttention`): block-sparse attention on the
    sparse denoising steps. Without a prologue, dense steps run the wrapped
    ``WanAttnProcessor`` itself; any call this processor was not written for
    (cross-attention, I2V's image keys, no rotary embedding) always does. A call with an
    attention mask (SkyReels-V2's causal frame blocks) runs dense, with the mask, as
    diffusers calls it (the prologue fused): block-sparse attention takes no mask, so on
    a sparse step such a call runs dense and ditops warns once.

    One subclass per diffusers processor class it wraps (:attr:`wraps`: Wan's and the
    copies in ChronoEdit, SkyReels-V2 and Wan-Animate), so that ``type(p)()`` builds one
    wrapping the model's own processor class.

    Under diffusers' context parallelism (:mod:`ditops.integrations.shared.parallel`): the
    config lives on the wrapped processor (``_parallel_config`` and ``_attention_backend``
    read and write through), so ``enable_parallelism`` after the patch reaches it, a patch
    after ``enable_parallelism`` (or ``from_pretrained(parallel_config=...)``) finds the
    config there, and ``unpatch`` leaves it in place. Dense attention is diffusers'
    ``dispatch_attention_fn`` with that config (its own exchange), as in the unpatched
    model. Sparse steps exchange q/k/v so that each rank estimates and attends over the
    whole sequence for its heads; with sparsity and ``ring_degree > 1`` ditops exchanges
    at every step and dense steps run diffusers' attention backend on the exchanged heads.
    """

    #: The diffusers processor this class wraps: (module, class name).
    wraps = ("diffusers.models.transformers.transformer_wan", "WanAttnProcessor")

    def __init__(
        self,
        original: Any | None = None,
        ops: QKOps | None = None,
        steps: StepState | None = None,
        sparse: nn.Module | None = None,
    ) -> None:
        super().__init__(original, ops, steps, sparse)
        self._qkv = self.qkv_projections()  # resolved once: not traced under compile
        self.prologue = None if ops is None else ops.qk  # the fused q/k norm + rotary

    def _dense_now(self) -> bool:
        return runs_dense(self.sparse, self.steps)

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if float64_call(hidden_states):  # cast after the patch: the meaning, dense
            return self.original(
                attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb
            )
        cp = context_parallel_of(self._parallel_config)
        dense = self._dense_now()
        # ditops' exchange runs dense steps too when sparse steps run under Ring.
        ours = not dense or (self.sparse is not None and cp is not None and cp.ring_degree > 1)
        prologue = (
            self.prologue is not None
            and rotary_emb is not None
            and PROLOGUE_BYPASS.problem(attn) is None  # hooked or replaced norms: called
        )
        if attention_mask is not None and encoder_hidden_states is None:
            if not dense:
                _warn_once(
                    "ditops: a self-attention call with an attention mask (SkyReels-V2's "
                    "causal frame blocks) runs dense attention with the mask on sparse steps "
                    "too: block-sparse attention takes no mask"
                )
            ours = False  # diffusers' attention, with the mask, as the model calls it
        if (
            encoder_hidden_states is not None
            or getattr(attn, "add_k_proj", None) is not None
            or (not ours and not prologue)
        ):
            return self.original(
                attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb
            )
        if ours and not dense and cp is not None and self.sparse is not None:
            check_method_per_rank(self.sparse.config.method)  # before any work
        query, key, value = self._qkv(attn, hidden_states, None)
        query, key = self._norm_rope(attn, query, key, rotary_emb, prologue)
        value = value.unflatten(2, (attn.heads, -1))
        if not ours:  # dense, as WanAttnProcessor calls it (diffusers' exchange, if any)
            out = self._dispatch_dense(query, key, value, attention_mask)
        else:
            attend = self._dense if dense else self._sparse
            if cp is None:
                out = attend(query, key, value)
            else:
                out = attend_across_ranks(cp, query, key, value, attend)
        out = out.flatten(2, 3).type_as(query)
        out = attn.to_out[0](out)
        return attn.to_out[1](out)

    @classmethod
    def qkv_projections(cls) -> Any:
        """``_get_qkv_projections`` of the module of the processor wrapped (its fingerprint
        is checked when patching)."""
        return importlib.import_module(cls.wraps[0])._get_qkv_projections

    def _norm_rope(
        self,
        attn: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None,
        prologue: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``norm_q``/``norm_k`` (across heads), split into heads, rotary embedding: the
        fused op when ``prologue``, else the norms called as modules (their hooks run)."""
        heads = attn.heads
        if prologue:
            assert self.prologue is not None and rotary_emb is not None
            cos, sin = rotary_emb
            return self.prologue(
                query.unflatten(2, (heads, -1)),
                key.unflatten(2, (heads, -1)),
                attn.norm_q.weight,
                attn.norm_k.weight,
                cos[..., 0::2],  # the entries WanAttnProcessor reads
                sin[..., 1::2],
                attn.norm_q.eps,
                across_heads=True,
            )
        query = attn.norm_q(query).unflatten(2, (heads, -1))
        key = attn.norm_k(key).unflatten(2, (heads, -1))
        if rotary_emb is not None:
            query = _apply_rotary(query, *rotary_emb)
            key = _apply_rotary(key, *rotary_emb)
        return query, key

    def _sparse(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Estimate + block-sparse attention over the whole sequence ([B, S, N, D])."""
        assert self.sparse is not None and self.steps is not None
        from ditops.attention.schedule import first_frame_dense_blocks

        shape = self.steps.latent_shape  # the whole video: recorded before any split
        dense = None  # passed per call, not set on the layer: threads share it
        if shape is not None:
            dense = first_frame_dense_blocks(
                shape, self.steps.patch_size, self.sparse.config.block_size
            )
        return self.sparse(
            q,
            k,
            v,
            layout="BSND",
            step=self.steps.current(),
            branch=self.steps.branch,
            dense_blocks=dense,
        )

    def _dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Dense attention as WanAttnProcessor runs it on one device (its backend)."""
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        return dispatch_attention_fn(
            q, k, v, dropout_p=0.0, is_causal=False, backend=self._attention_backend
        )


class ChronoEditSelfAttnProcessor(WanSelfAttnProcessor):
    """:class:`WanSelfAttnProcessor` over ChronoEdit's copy of ``WanAttnProcessor``."""

    wraps = ("diffusers.models.transformers.transformer_chronoedit", "WanAttnProcessor")


class SkyReelsV2SelfAttnProcessor(WanSelfAttnProcessor):
    """:class:`WanSelfAttnProcessor` over ``SkyReelsV2AttnProcessor``."""

    wraps = ("diffusers.models.transformers.transformer_skyreels_v2", "SkyReelsV2AttnProcessor")


class WanAnimateSelfAttnProcessor(WanSelfAttnProcessor):
    """:class:`WanSelfAttnProcessor` over Wan-Animate's copy of ``WanAttnProcessor``."""

    wraps = ("diffusers.models.transformers.transformer_wan_animate", "WanAttnProcessor")


#: diffusers' processor (module, class name) -> ditops' processor wrapping it.
PROCESSORS: dict[tuple[str, str], type[WanSelfAttnProcessor]] = {
    cls.wraps: cls
    for cls in (
        WanSelfAttnProcessor,
        ChronoEditSelfAttnProcessor,
        SkyReelsV2SelfAttnProcessor,
        WanAnimateSelfAttnProcessor,
    )
}

_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)
