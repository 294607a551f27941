"""The NPU paths of the attention ops: kernels, their per-call limits, the calls.

sgl-kernel-npu's ``sparse_block_estimate`` and ``ada_block_sparse_attention``
(:func:`ditops.backends.npu.npu_kernel` resolves the current or the legacy package).
Their per-call limits are path reasons, checked before a call, so an input a kernel
would reject runs ``forward_native`` with the reason in ``explain_call`` instead of
failing inside the kernel (which would give up the fast path for the whole process).
The limits are those the current package documents (block size a multiple of 128 in
[128, 512], layouts BNSD/BSND/BSH, positive dims) plus two its tiling code enforces
(head dim <= 512, at most 256 query heads). They apply to the legacy package too: it
runs the same kernels without checking its arguments, and sizes outside these limits
were never documented to work there.
"""

from __future__ import annotations

from typing import Any

import torch

from ditops.attention.block_mask import num_blocks, row_counts
from ditops.attention.estimate import force_dense_blocks
from ditops.attention.selection import BlockSelection, block_budget, selection_of
from ditops.backends.npu import NpuCall, npu_kernel
from ditops.ops.attention_args import AttentionCall, EstimateCall, softmax_scale

NPU_ESTIMATE = npu_kernel(
    "sparse_block_estimate", current=("sparse_block_estimate",), legacy=("sparse_block_estimate",)
)
NPU_ATTENTION = npu_kernel(
    "ada_block_sparse_attention",
    current=("ada_block_sparse_attention",),
    legacy=("ada_block_sparse_attention", "block_sparse_attention"),
)

#: Layouts the kernels take (TND is not exposed by the current package).
KERNEL_LAYOUTS = ("BNSD", "BSND", "BSH")
#: Block sizes: a multiple of 128 in [128, 512].
BLOCK_SIZE_STEP, BLOCK_SIZE_MAX = 128, 512
#: From the attention kernel's tiling: head dim <= 512, at most 256 query heads.
MAX_HEAD_DIM, MAX_HEADS = 512, 256


def block_size_reasons(block_size: int, stride: int | None = None) -> list[str]:
    """Why the kernels cannot take this block size (and estimator stride)."""
    reasons = []
    if block_size % BLOCK_SIZE_STEP or not BLOCK_SIZE_STEP <= block_size <= BLOCK_SIZE_MAX:
        reasons.append(
            f"block_size {block_size}: the NPU kernels take a multiple of {BLOCK_SIZE_STEP} "
            f"in [{BLOCK_SIZE_STEP}, {BLOCK_SIZE_MAX}]"
        )
    if stride is not None and (stride < 1 or block_size % stride):
        reasons.append(f"stride {stride} does not divide block_size {block_size}")
    return reasons


def input_reasons(layout: str, *tensors: torch.Tensor) -> list[str]:
    """Why the kernels cannot take inputs in ``layout`` with these shapes."""
    reasons = []
    if layout not in KERNEL_LAYOUTS:
        reasons.append(f"layout {layout}: the NPU kernels take {'/'.join(KERNEL_LAYOUTS)}")
    if any(t.numel() == 0 for t in tensors):
        reasons.append("an empty input: the NPU kernels take positive dims only")
    return reasons


def attention_kernel_reasons(q: torch.Tensor, v: torch.Tensor) -> list[str]:
    """Why ada_block_sparse_attention cannot take these [B, N, S, D] views of q and v."""
    reasons = []
    if q.shape[3] > MAX_HEAD_DIM:
        reasons.append(f"head dim {q.shape[3]}: the NPU kernel takes at most {MAX_HEAD_DIM}")
    if q.shape[1] > MAX_HEADS:
        reasons.append(f"{q.shape[1]} query heads: the NPU kernel takes at most {MAX_HEADS}")
    if v.shape[3] != q.shape[3]:
        reasons.append(
            f"v's head dim {v.shape[3]} differs from q's {q.shape[3]}: the NPU kernel "
            "returns the query's shape"
        )
    return reasons


def inner_precise(call: NpuCall, dtype: torch.dtype) -> int:
    """``inner_precise`` for ada_block_sparse_attention: 0 (high precision) where the
    package has it for ``dtype``, else 1 (high performance: fp16 on sgl_kernel_npu)."""
    if dtype == torch.float16 and not call.package.fp16_high_precision:
        return 1
    return 0


# --- estimate_block_mask on the NPU ----------------------------------------------------


def estimate_reasons(c: EstimateCall) -> list[str]:
    """What the NPU estimator cannot take (its method, budget, inputs, lengths)."""
    sel = c.sel
    if sel.scoring != "antidiagonal":
        return [
            f"method {sel.method!r} scores sampled query rows; the NPU estimate computes "
            "antidiagonal scores only (the meaning runs: plain torch on this device)"
        ]
    if sel.mass is not None:
        return [
            "a mass target (mass=...): the NPU kernel takes a density per row only (the "
            "meaning runs: plain torch on this device)"
        ]
    if sel.allocation != "row":
        return [
            f"method {sel.method!r} spends one budget per {sel.allocation}; the NPU kernel "
            "takes a budget per row only"
        ]
    reasons = input_reasons(c.layout, c.q, c.k)
    reasons += block_size_reasons(c.block_size, c.stride)
    q_len, kv_len = int(c.qb.shape[2]), int(c.kb.shape[2])
    if q_len != kv_len:
        # The legacy estimator takes both block dims from the query length; the current
        # one's cross-length scoring is not documented: only self-attention is sent.
        reasons.append(
            f"the NPU sparse_block_estimate is used for self-attention only; q has {q_len} "
            f"tokens, k {kv_len}"
        )
    if sel.in_budget and sel.dense_blocks > 0 and sel.threshold < 1.0:
        # The kernel's threshold would count the first frame's columns' mass.
        reasons.append(
            "threshold < 1 with first-frame blocks under forced_blocks='in_budget': the "
            "NPU kernel cannot leave the first frame's columns out of the threshold"
        )
    return reasons


def npu_in_budget_ratio(
    q_blocks: int, kv_blocks: int, sel: BlockSelection | None = None, **fields: Any
) -> float:
    """The ``row_sparse`` to give the NPU estimator for the in-budget reading.

    The kernel keeps ``int(candidates * row_sparse)`` scored blocks per row (sink and
    recent excluded, first-frame columns not), in fp32. Asked for, in every row, that
    row's in-budget share plus the first-frame columns it may spend its top-k on, it
    keeps a superset of the in-budget selection.
    """
    sel = selection_of(sel, fields)
    budget = block_budget(q_blocks, kv_blocks, sel)
    dense = sel.dense_blocks
    ratio = 0.0
    for r, share in enumerate(budget.per_row):
        n = min(r + 1, kv_blocks) if sel.causal else kv_blocks
        if r < dense or n == 0:
            continue  # forced dense afterwards
        # First-frame columns the kernel scores (column 0 is the sink when kept).
        frame = max(0, min(dense, n) - (1 if sel.keep_sink else 0))
        if sel.keep_recent and n - 1 < dense:
            frame -= 1
        want = share + max(frame, 0)
        # The midpoint, so the kernel's fp32 floor gives ``want`` exactly.
        ratio = max(ratio, min(1.0, (want + 0.5) / n))
    return ratio if ratio > 0 else 0.5 / max(kv_blocks, 1)


def npu_estimate(c: EstimateCall) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel selects per row with one top-k ratio and sink/recent on top
    (sglang's reading); ditops forces the first frame afterwards.

    ``in_budget``: the kernel cannot leave the first frame's columns out of its
    ranking, nor take a budget per row, so it is asked for the largest row budget
    plus those columns (:func:`npu_in_budget_ratio`): its mask holds every block of
    the meaning's (ties aside) and a few more: without ``causal``, at most
    ``dense_blocks + 1`` per row (a density at most ``(dense_blocks + 1) / KVb``
    above the one asked for; Wan's 21 latent frames: 0.06). Under ``causal`` more
    (one ratio for rows of every length; rows of under 10 candidates keep all).
    """
    sel = c.sel
    kv_blocks = num_blocks(int(c.kb.shape[2]), c.block_size)
    keep_ratio = sel.keep_ratio
    if sel.in_budget:
        q_blocks = num_blocks(int(c.qb.shape[2]), c.block_size)
        keep_ratio = npu_in_budget_ratio(q_blocks, kv_blocks, sel)
    mask, _counts = NPU_ESTIMATE.op()(
        c.q.contiguous(),
        c.k.contiguous(),
        actual_seq_lengths=None,
        actual_seq_lengths_kv=None,
        input_layout=c.layout,
        stride=c.stride,
        sparse_size=c.block_size,
        num_heads=int(c.qb.shape[1]),
        num_key_value_heads=int(c.kb.shape[1]),
        scale_value=softmax_scale(c.qb, c.scale) / c.stride,
        threshold=sel.threshold,
        causal=sel.causal,
        keep_sink=sel.keep_sink,
        keep_recent=sel.keep_recent,
        row_sparse=keep_ratio,
    )
    # The NPU pads the column dim to a multiple of 32; the counts must be recomputed
    # after forcing the first frame anyway.
    mask = force_dense_blocks(mask[..., :kv_blocks], sel.dense_blocks, causal=sel.causal)
    return mask.contiguous(), row_counts(mask)


# --- block_sparse_attention on the NPU -------------------------------------------------


def attention_reasons(c: AttentionCall) -> list[str]:
    """What ada_block_sparse_attention cannot take."""
    reasons = input_reasons(c.layout, c.q, c.k, c.v)
    reasons += block_size_reasons(c.block_size)
    reasons += attention_kernel_reasons(c.qb, c.vb)
    return reasons


def npu_attention(c: AttentionCall) -> torch.Tensor:
    call = NPU_ATTENTION.resolved()
    out = call.fn(
        c.q.contiguous(),
        c.k.contiguous(),
        c.v.contiguous(),
        c.mask.to(torch.int8).contiguous(),
        c.counts.to(torch.int32).contiguous(),
        input_layout=c.layout,
        sparse_size=c.block_size,
        num_heads=int(c.qb.shape[1]),
        num_key_value_heads=int(c.kb.shape[1]),
        scale_value=softmax_scale(c.qb, c.scale),
        causal=c.causal,
        # 0 = high precision; fp16 on sgl_kernel_npu has only 1 (high performance).
        inner_precise=inner_precise(call, c.q.dtype),
    )
    return out.to(c.q.dtype)
