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

from ditops.attention.block_mask import MaskDensity, density_stats
from ditops.attention.layout import to_bnsd
from ditops.attention.permute import TokenPermutation, choose_heads, cluster_permutation
from ditops.attention.schedule import BlockSparseConfig, first_frame_dense_blocks
from ditops.core.checks import as_int
from ditops.ops.attention_args import check_layout, from_bnsd
from ditops.ops.block_sparse_attention import block_sparse_attention
from ditops.ops.estimate_block_mask import estimate_block_mask
from ditops.tracing import refuse_under_fullgraph, traced


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
    #: The permuted mode's token permutation the mask is in (its centroids warm-start
    #: the next estimate); ``None`` in the original order.
    perm: TokenPermutation | None = None


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
        self._last_run: tuple[torch.Tensor, int, int] | None = None
        #: The permuted mode's last permutation (eager calls): tests and benches read it.
        self._last_permutation: TokenPermutation | None = None
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

    def last_density(self) -> MaskDensity | None:
        """The density of the block mask the last eager sparse call ran
        (:func:`ditops.attention.block_mask.density_stats` of that very mask: per head,
        per row, overall); ``None`` when that call ran dense, or none ran yet. With a
        mass target (``config.mass``) this is where the density that resulted is read.
        Computed on demand (reads the mask: on an accelerator, waits for it); calls
        inside ``torch.compile`` are not recorded."""
        if self._last_run is None:
            return None
        mask, q_len, kv_len = self._last_run
        cfg = self.config
        return density_stats(
            mask, q_len=q_len, kv_len=kv_len, block_size=cfg.block_size, causal=cfg.causal
        )

    def _remember_run(
        self, mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor, layout: str
    ) -> None:
        if not traced():  # a module attribute written inside a trace would be a side effect
            seq = 2 if layout == "BNSD" else 1
            self._last_run = (mask, int(q.shape[seq]), int(k.shape[seq]))

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
        self.check_fullgraph()
        step = self.step if step is None else step
        if cfg.dense_at(step):
            if not traced():
                self._last_run = None
            return dense_attention(q, k, v, layout=layout, scale=scale, causal=cfg.causal)
        dense = self.dense_blocks if dense_blocks is None else dense_blocks
        if cfg.permute:
            return self._permuted(
                q, k, v, layout=layout, scale=scale, step=step, branch=branch, dense_blocks=dense
            )
        mask, counts = self._block_mask(
            q, k, layout=layout, scale=scale, step=step, branch=branch, dense_blocks=dense
        )
        self._remember_run(mask, q, k, layout)
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

    def check_fullgraph(self) -> None:
        """Under a ``torch.compile(..., fullgraph=True)`` trace, refuse mask reuse
        (``estimate_every > 1``: its bookkeeping runs eagerly, a graph break) with an
        error that says what to change. Callers that decide dense or sparse themselves
        (the model integrations) call it on every step, so a dense step refuses too."""
        if self.config.estimate_every > 1 and traced():
            refuse_under_fullgraph(_reuse_breaks_the_graph(self.config.estimate_every))

    def _permutation(
        self,
        qb: torch.Tensor,
        kb: torch.Tensor,
        dense_blocks: int,
        previous: TokenPermutation | None,
        scale: float | None,
    ) -> TokenPermutation:
        """Clusters warm-started from ``previous``; from a cold start, each head also
        chooses between the clustered and the original order (:func:`choose_heads`)."""
        cfg = self.config
        perm = cluster_permutation(
            qb,
            kb,
            fixed=dense_blocks * cfg.block_size,
            clusters=cfg.clusters or None,
            block_size=cfg.block_size,
            previous=previous,
        )
        if previous is None:
            keep = None if cfg.mass is not None else cfg.keep_ratio
            perm = choose_heads(qb, kb, perm, block_size=cfg.block_size, keep=keep, scale=scale)
        return perm

    def _permuted(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        layout: str,
        scale: float | None,
        step: int | None,
        branch: str | None,
        dense_blocks: int,
    ) -> torch.Tensor:
        """The permuted mode (:mod:`ditops.attention.permute`): tokens clustered per head
        and sorted by cluster, the mask estimated and block-sparse attention run in that
        order, the output rows put back."""
        check_layout("BlockSparseAttention", layout)
        qb, kb, vb = to_bnsd(q, layout), to_bnsd(k, layout), to_bnsd(v, layout)
        if step is None:  # no step: nothing to reuse, a cold start every call
            perm = self._permutation(qb, kb, dense_blocks, None, scale)
            qp, kp = perm.permute_q(qb), perm.permute_kv(kb)
            mask, counts = self._estimate(
                qp, kp, layout="BNSD", scale=scale, dense_blocks=dense_blocks
            )
        else:
            kept_or_new = _eager_kept_or_new_mask()
            entry, permuted = kept_or_new(
                self,
                qb,
                kb,
                layout="BNSD",
                scale=scale,
                step=step,
                branch=branch,
                dense_blocks=dense_blocks,
            )
            mask, counts, perm = entry.mask, entry.counts, entry.perm
            assert perm is not None
            qp, kp = permuted or (perm.permute_q(qb), perm.permute_kv(kb))
        self._remember_run(mask, q, k, layout)
        if not traced():
            self._last_permutation = perm
        out = block_sparse_attention(
            qp,
            kp,
            perm.permute_kv(vb),
            mask,
            counts,
            layout="BNSD",
            scale=scale,
            causal=self.config.causal,
            block_size=self.config.block_size,
        )
        return from_bnsd(perm.unpermute(out), layout)

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
            keep_ratio=None if cfg.mass is not None else cfg.keep_ratio,
            mass=cfg.mass,
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
        entry, _ = kept_or_new(
            self,
            q,
            k,
            layout=layout,
            scale=scale,
            step=step,
            branch=branch,
            dense_blocks=dense_blocks,
        )
        return entry.mask, entry.counts

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
    ) -> tuple[_CachedMask, tuple[torch.Tensor, torch.Tensor] | None]:
        """The branch's mask, reused or estimated; when estimated in the permuted mode,
        also the permuted q and k it was estimated on (the attention reuses them)."""
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
            return entry, None
        masks.pop(branch, None)  # the old mask goes before the new one is made
        perm, permuted = None, None
        if self.config.permute:  # q, k are BNSD here; last step's centroids warm-start
            warm = entry is not None and entry.key == key and entry.last_step < step
            previous = entry.perm if warm and entry is not None else None
            perm = self._permutation(q, k, dense_blocks, previous, scale)
            q, k = permuted = perm.permute_q(q), perm.permute_kv(k)
        mask, counts = self._estimate(q, k, layout=layout, scale=scale, dense_blocks=dense_blocks)
        entry = masks[branch] = _CachedMask(key, mask, counts, step, step, perm)
        while len(masks) > MAX_MASK_BRANCHES:
            masks.popitem(last=False)
        return entry, permuted

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


def _reuse_breaks_the_graph(every: int | None) -> str:
    asked = "estimate_every > 1" if every is None else f"estimate_every={every}"
    return (
        f"ditops: sparse attention with mask reuse (BlockSparseConfig({asked})) "
        "cannot compile with fullgraph=True: the masks kept between steps are Python state "
        "that runs eagerly (a graph break around each estimate). Set estimate_every=1, or "
        "compile with fullgraph=False."
    )


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
        _EAGER_KEPT_OR_NEW = torch.compiler.disable(
            BlockSparseAttention._kept_or_new_mask, reason=_reuse_breaks_the_graph(None)
        )
    return _EAGER_KEPT_OR_NEW


__all__ = [
    "MAX_MASK_BRANCHES",
    "BlockSparseAttention",
    "dense_attention",
]
