"""Compiled FlexAttention: the block-sparse attention kernel on CPU and CUDA.

FlexAttention is only fast compiled (``torch.compile``); uncompiled it is a slow
reference. One compiled function serves every call; ``torch.compile`` keeps one
specialised graph per shape (``dynamic=False``: a dynamic-shape graph is slower and
compiles longer), and compiling a new shape takes seconds. Video DiTs use a
handful of shapes per run, so the recompile limit is raised for these calls only: a
new shape must never silently fall back to eager FlexAttention.

On CPU, when no ``mask_mod`` is needed (not causal) the ``SKIP_MASK_SCORE`` kernel
option drops the per-element mask pass: FlexAttention's CPU kernel already stops at
the real sequence length, so the selected blocks need no element mask at all.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from ditops.tracing import traced

logger = logging.getLogger("ditops")

# Distinct shapes one process may compile before torch.compile would give up and run
# FlexAttention eagerly (hundreds of times slower).
RECOMPILE_LIMIT = 64

_lock = threading.Lock()
_calls = threading.RLock()
_compiled: Any = None
_seen: set[tuple[Any, ...]] = set()


def _compiled_flex() -> Any:
    global _compiled
    if _compiled is None:
        with _lock:
            if _compiled is None:
                _compiled = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    return _compiled


def flex_block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: BlockMask,
    *,
    scale: float,
    needs_mask_mod: bool,
) -> torch.Tensor:
    """Run compiled FlexAttention on ``[B, N, S, D]`` tensors with a block mask.

    ``needs_mask_mod``: the block mask's ``mask_mod`` must be applied inside blocks
    (causal). When it is not, CPU runs skip the element-mask pass.
    """
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    options: dict[str, Any] | None = None
    if q.device.type == "cpu" and not needs_mask_mod:
        options = {"SKIP_MASK_SCORE": True}
    enable_gqa = q.shape[1] != k.shape[1]
    if traced():
        # Inside a user's torch.compile: traced into their graph.
        return flex_attention(
            q,
            k,
            v,
            block_mask=block_mask,
            scale=scale,
            enable_gqa=enable_gqa,
            kernel_options=options,
        )
    key = (
        q.device.type,
        q.dtype,
        tuple(q.shape),
        tuple(k.shape),
        tuple(v.shape),
        block_mask.BLOCK_SIZE,
        needs_mask_mod,
        scale,
    )
    if key not in _seen:
        _seen.add(key)
        logger.info(
            "ditops: compiling FlexAttention for q %s, k %s, %s on %s (once per shape)",
            list(q.shape),
            list(k.shape),
            str(q.dtype).replace("torch.", ""),
            q.device.type,
        )
    # One call at a time: ``config.patch`` sets a process-wide value and restores it on
    # exit, so a second thread inside it could lose the raised limit mid-call and run
    # FlexAttention eagerly (slow; the block mask's mask_mod keeps that correct).
    with _calls, torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
        return _compiled_flex()(
            q,
            k,
            v,
            block_mask=block_mask,
            scale=scale,
            enable_gqa=enable_gqa,
            kernel_options=options,
        )
