"""Adaptive block-sparse attention, the module users put in models.

:class:`BlockSparseAttention` puts the two ops,
:data:`ditops.ops.estimate_block_mask.estimate_block_mask` and
:data:`ditops.ops.block_sparse_attention.block_sparse_attention`, behind a schedule
(:class:`ditops.attention.schedule.BlockSparseConfig`): dense SDPA
(:func:`dense_attention`) for the first denoising steps and at sparsity 0, estimate +
sparse attention after, with the masks kept for reuse per guidance branch.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ditops.attention.layout import to_bnsd
from ditops.attention.schedule import BlockSparseConfig, first_frame_dense_blocks
from ditops.core.checks import as_int
from ditops.ops.attention_args import check_layout, from_bnsd
from ditops.ops.block_sparse_attention import block_sparse_attention
from ditops.ops.estimate_block_mask import estimate_block_mask


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layout: str = "BNSD",
    scale: float | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """Dense SDPA in ``layout`` (GQA allowed): what the sparse layer runs when dense."""
    check_layout("dense_attention", layout)
    qb, kb, vb = to_bnsd(q, layout), to_bnsd(k, layout), to_bnsd(v, layout)
    out = F.scaled_dot_product_attention(
        qb, kb, vb, is_causal=causal, scale=scale, enable_gqa=qb.shape[1] != kb.shape[1]
    )
    return from_bnsd(out, layout)


#: Guidance branches (cache context names) whose masks a layer keeps; past this many
#: the least recently used goes (diffusers pipelines use one to three).
MAX_MASK_BRANCHES = 4


@dataclass
class _CachedMask:
    """A layer's mask for one guidance branch, and when it was estimated."""

    key: tuple[Any, ...]
    mask: torch.Tensor
    counts: torch.Tensor
    estimated_at: int
    last_step: int


class BlockSparseAttention(nn.Module):
    """Adaptive block-sparse attention with a denoising schedule.

    Each call, unless the schedule says dense (sparsity 0, or a step before
    ``skip_first_steps``), runs :data:`block_sparse_attention` with a block mask from
    :data:`estimate_block_mask`; dense calls run SDPA. The first video frame's blocks
    are kept dense once :meth:`set_video_shape` (or ``dense_blocks``) says how many there
    are.

    **Mask reuse** (``config.estimate_every = N > 1``): the mask is estimated at a sparse
    step ``s`` and reused for steps ``s + 1 .. s + N - 1``, separately for each guidance
    ``branch`` (classifier-free guidance's "cond" and "uncond" calls see different
    inputs). The layer keeps one int8 mask per branch (``B * heads * Qb * KVb`` bytes,
    at most :data:`MAX_MASK_BRANCHES` branches). A call whose step is not after the last
    one of its branch starts afresh (a new pipeline call: within one, a branch sees each
    step once), as does a change of shapes, layout, scale, device or first-frame blocks.
    Without a step (``None``), every call estimates. :meth:`clear_masks` drops them.

    Args:
        config: a :class:`BlockSparseConfig`; or give its fields as keyword arguments.
        dense_blocks: leading block rows/columns always kept (the first frame).
    """

    def __init__(
        self, config: BlockSparseConfig | None = None, *, dense_blocks: int = 0, **fields: Any
    ) -> None:
        super().__init__()
        if config is not None and fields:
            raise TypeError(
                "BlockSparseAttention: give a config or its fields, not both "
                f"(got config and {sorted(fields)})"
            )
        self.config = config if config is not None else BlockSparseConfig(**fields)
        blocks = as_int(dense_blocks)
        if blocks is None or blocks < 0:
            raise ValueError(f"dense_blocks must be an int >= 0, got {dense_blocks!r}")
        self.dense_blocks = blocks
        self.step: int | None = None
        # Per thread (its ident), per branch: see _thread_masks.
        self._masks: dict[int, OrderedDict[str | None, _CachedMask]] = {}
        if self.config.estimate_every > 1:
            _eager_kept_or_new_mask()  # made now, before any torch.compile trace

    def set_step(self, step: int | None) -> None:
        """The denoising step index of the next calls (``None``: unknown); an int >= 0."""
        number = None if step is None else as_int(step)
        if step is not None and (number is None or number < 0):
            raise ValueError(f"set_step: step must be an int >= 0 or None, got {step!r}")
        self.step = number

    def set_video_shape(self, latent_shape: Sequence[int], patch_size: int | Sequence[int]) -> None:
        """Keep the first frame dense: ``ceil(frame_tokens / block_size)`` blocks."""
        self.dense_blocks = first_frame_dense_blocks(
            latent_shape, patch_size, self.config.block_size
        )

    def clear_masks(self) -> None:
        """Forget the masks kept for reuse (the next sparse call of each branch estimates)."""
        self._masks.clear()

    def extra_repr(self) -> str:
        return f"{self.config}, dense_blocks={self.dense_blocks}"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        layout: str = "BNSD",
        scale: float | None = None,
        step: int | None = None,
        branch: str | None = None,
        dense_blocks: int | None = None,
    ) -> torch.Tensor:
        """Attention of q over k/v in ``layout``; ``step`` overrides :meth:`set_step`;
        ``branch`` names the guidance branch (the pipeline's cache context name) whose
        mask is reused; ``dense_blocks`` overrides the layer's for this call (a
        caller serving several videos at once passes each its own)."""
        cfg = self.config
        step = self.step if step is None else step
        if cfg.dense_at(step):
            return dense_attention(q, k, v, layout=layout, scale=scale, causal=cfg.causal)
        dense = self.dense_blocks if dense_blocks is None else dense_blocks
        mask, counts = self._block_mask(
            q, k, layout=layout, scale=scale, step=step, branch=branch, dense_blocks=dense
        )
        return block_sparse_attention(
            q,
            k,
            v,
            mask,
            counts,
            layout=layout,
            scale=scale,
            causal=cfg.causal,
            block_size=cfg.block_size,
        )

    def _estimate(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        *,
        layout: str,
        scale: float | None,
        dense_blocks: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.config
        return estimate_block_mask(
            q,
            k,
            layout=layout,
            block_size=cfg.block_size,
            stride=cfg.stride,
            scale=scale,
            threshold=cfg.threshold,
            keep_ratio=cfg.keep_ratio,
            keep_sink=cfg.keep_sink,
            keep_recent=cfg.keep_recent,
            causal=cfg.causal,
            dense_blocks=dense_blocks,
            forced_blocks=cfg.forced_blocks,
            method=cfg.method,
            samples=cfg.samples,
        )

    def _block_mask(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        *,
        layout: str,
        scale: float | None,
        step: int | None,
        branch: str | None,
        dense_blocks: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This call's mask: estimated, or reused (see the class docstring)."""
        if self.config.estimate_every == 1 or step is None:
            return self._estimate(q, k, layout=layout, scale=scale, dense_blocks=dense_blocks)
        kept_or_new = _eager_kept_or_new_mask()
        return kept_or_new(
            self,
            q,
            k,
            layout=layout,
            scale=scale,
            step=step,
            branch=branch,
            dense_blocks=dense_blocks,
        )

    def _kept_or_new_mask(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        *,
        layout: str,
        scale: float | None,
        step: int,
        branch: str | None,
        dense_blocks: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        every = self.config.estimate_every
        key = (tuple(q.shape), tuple(k.shape), layout, scale, q.device, dense_blocks, self.config)
        masks = self._thread_masks()
        entry = masks.get(branch)
        if (
            entry is not None
            and entry.key == key
            and entry.last_step < step < entry.estimated_at + every
        ):
            entry.last_step = step
            masks.move_to_end(branch)
            return entry.mask, entry.counts
        masks.pop(branch, None)  # the old mask goes before the new one is made
        mask, counts = self._estimate(q, k, layout=layout, scale=scale, dense_blocks=dense_blocks)
        masks[branch] = _CachedMask(key, mask, counts, step, step)
        while len(masks) > MAX_MASK_BRANCHES:
            masks.popitem(last=False)
        return mask, counts

    def _thread_masks(self) -> OrderedDict[str | None, _CachedMask]:
        """The calling thread's masks: threads sharing a model each run their own
        denoising loop, so one must never reuse another's mask. Masks of threads that
        ended are dropped here."""
        ident = threading.get_ident()
        masks = self._masks.get(ident)
        if masks is None:
            alive = {t.ident for t in threading.enumerate()}
            for gone in [i for i in self._masks if i not in alive]:
                del self._masks[gone]
            masks = self._masks[ident] = OrderedDict()
        return masks


_EAGER_KEPT_OR_NEW: Any = None


def _eager_kept_or_new_mask() -> Any:
    """``BlockSparseAttention._kept_or_new_mask`` under ``torch.compiler.disable``.

    torch.compile: the reuse bookkeeping reads and writes Python ints (steps) that dynamo
    would specialise on, one graph per step until its recompile limit; it runs eagerly
    instead (a graph break around the estimate, one graph for the rest). Made on first
    need, not at import: ``torch.compiler.disable`` imports ``torch._dynamo`` (and with it
    Triton), which ``import ditops`` must not. A module asking for reuse makes it when
    built, so it exists before any trace reads it.
    """
    global _EAGER_KEPT_OR_NEW
    if _EAGER_KEPT_OR_NEW is None:
        _EAGER_KEPT_OR_NEW = torch.compiler.disable(BlockSparseAttention._kept_or_new_mask)
    return _EAGER_KEPT_OR_NEW


__all__ = [
    "MAX_MASK_BRANCHES",
    "BlockSparseAttention",
    "dense_attention",
]
