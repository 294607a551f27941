"""Adaptive block-sparse attention: mask estimation, sparse attention, and the layer.

Two ops, each a registered CustomOp with a functional entry point of the same name:

- ``estimate_block_mask(q, k, ...) -> (mask, counts)``: the XAttention-style estimate
  of :mod:`ditops.attention.estimate`. Paths: native (plain torch, every device);
  ``npu`` through sgl-kernel-npu's ``sparse_block_estimate`` (``torch.ops.npu`` from
  ``sgl_kernel_npu``, else the legacy ``torch.ops.attentions``) followed by the same
  first-frame forcing and count recomputation; ``cuda``/``hip``/``xpu`` through a Triton
  kernel for the block scores (:mod:`ditops.kernels.triton.estimate`) followed by the
  native selection (:func:`ditops.attention.estimate.mask_from_scores`).
- ``block_sparse_attention(q, k, v, mask, counts, ...)``: softmax over the union of the
  selected key blocks (:mod:`ditops.attention.reference` is the meaning). Paths:
  native (fp32, memory-bounded); ``cpu`` gathers the selected key blocks and runs SDPA
  on them (no compile: :mod:`ditops.kernels.cpu.block_sparse_attention`);
  ``cuda``/``hip`` through compiled FlexAttention;
  ``npu`` through sgl-kernel-npu's ``ada_block_sparse_attention`` (``sgl_kernel_npu``,
  else the legacy ``attentions`` under that name or its older ``block_sparse_attention``).
  Other devices run native.

The NPU paths take bf16/fp16 only, self-attention for the estimate, block sizes that
are a multiple of 128 in [128, 512] and the kernels' other limits
(:mod:`ditops.backends.npu`); any other call runs native, with the reason in
``explain_call``.

NaN and inf in q, k or v propagate as in the meaning: such a call runs the meaning
(checked with one ``aminmax`` per tensor, about half a copy of it; inside a compiled
graph with ``torch.cond``).

Precision: every fast path is ``fast`` only (``exact`` runs native). For attention,
``fast`` means within ``ATTENTION_TOLERANCE`` of native (fp32 inside, rounded once):
SDPA's CPU flash kernel, FlexAttention and the NPU kernel round softmax probabilities to
the input dtype before the second matmul, as every flash-attention kernel does. One
exception: fp16 on ``sgl_kernel_npu``, which lacks the kernel's fp16 high-precision
specialization, runs its high-performance one (``inner_precise=1``), holding scores
and softmax in fp16: a logit ``l`` is then off by up to ``|l| * 2**-11``, and the
bound's ``atol`` grows by ``NPU_FP16_LOGIT_ATOL * max|logit|`` (bf16, and fp16 on the
legacy package, take the high-precision path). For the estimate, ``fast`` means the
NPU's fp16 block scores, or the Triton kernel's (within a few ulps of the input dtype of
native's), may break near-ties differently.

:class:`BlockSparseAttention` puts both behind a schedule
(:class:`ditops.attention.schedule.BlockSparseConfig`): dense SDPA for the first
denoising steps and at sparsity 0, estimate + sparse attention after.
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

from ditops.attention.block_mask import (
    num_blocks,
    row_counts,
    to_flex_block_mask,
    validate_block_mask,
)
from ditops.attention.estimate import (
    FORCED_BLOCKS,
    block_budget,
    estimate_block_mask_reference,
    force_dense_blocks,
    mask_from_scores,
    mask_without_scores,
)
from ditops.attention.estimate import block_scores as native_block_scores
from ditops.attention.layout import LAYOUTS, to_bnsd
from ditops.attention.methods import (
    DEFAULT_SAMPLES,
    METHODS,
    OP_DEFAULT_METHOD,
    check_method,
    sampled_block_scores,
)
from ditops.attention.reference import block_sparse_attention_reference
from ditops.attention.schedule import BlockSparseConfig, first_frame_dense_blocks
from ditops.backends import npu
from ditops.backends.triton import TRITON
from ditops.custom_op import CustomOp, fast_path, register_op
from ditops.platform import cpu_half_matmuls_slow

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_HALF = (torch.bfloat16, torch.float16)
NPU_ESTIMATE = npu.npu_kernel(
    "sparse_block_estimate", current=("sparse_block_estimate",), legacy=("sparse_block_estimate",)
)
NPU_ATTENTION = npu.npu_kernel(
    "ada_block_sparse_attention",
    current=("ada_block_sparse_attention",),
    legacy=("ada_block_sparse_attention", "block_sparse_attention"),
)
#: The Triton estimate holds whole blocks in a tile: at most this many strided rows per
#: block (``block_size / stride``); larger tiles would not fit a GPU's registers.
TRITON_ESTIMATE_MAX_CELLS = 128

#: ``fast`` tolerance of block_sparse_attention against native, per output dtype:
#: ``|out - native| <= atol * max|v| + rtol * |native|`` (about 1 ulp of max|v| in bf16;
#: measured on CPU FlexAttention: bf16 2e-3, fp16 2e-4, fp32 2e-7 of max|v|; the CPU
#: gathered-SDPA path: bf16 0.8e-3 to 3e-3, fp32 6e-8).
ATTENTION_TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (8e-3, 8e-3),
    torch.float16: (1e-3, 1e-3),
}
#: fp16 on sgl_kernel_npu (high-performance mode, scores in fp16): ``atol`` grows by this
#: times ``max|logit|`` (logit = scale * q.k). A logit rounded to fp16 moves by up to
#: ``|l| * 2**-11``, which moves a softmax-weighted mean of v by up to about twice that
#: times ``max|v|``. A CPU emulation of fp16 scores and softmax stayed within 0.3 of it.
NPU_FP16_LOGIT_ATOL = 2.0**-10


# --- argument checks -------------------------------------------------------------------


def _check_tensors(op: str, names: Sequence[str], tensors: Sequence[Any]) -> None:
    for name, t in zip(names, tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
        if t.dtype not in _FLOATS:
            raise TypeError(
                f"{op}: {name} dtype {t.dtype} not supported; expected float32, bfloat16 or float16"
            )
        if t.dim() != 4:
            raise ValueError(
                f"{op}: {name} must be 4-D ([B, N, S, D] or [B, S, N, D]), got shape "
                f"{list(t.shape)}"
            )
    first = tensors[0]
    for name, t in zip(names[1:], tensors[1:]):
        if t.dtype != first.dtype:
            raise TypeError(f"{op}: {name} dtype {t.dtype} differs from {names[0]} {first.dtype}")
        if t.device != first.device:
            raise ValueError(f"{op}: {name} is on {t.device}, {names[0]} on {first.device}")


def _check_layout(op: str, layout: object) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"{op}: layout must be one of {LAYOUTS}, got {layout!r}")


def _check_heads(op: str, q: torch.Tensor, k: torch.Tensor) -> None:
    """q/k as BNSD views: same batch and head dim, query heads a multiple of key heads."""
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"{op}: batch sizes differ: q {q.shape[0]}, k {k.shape[0]}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"{op}: query heads ({q.shape[1]}) must be a multiple of key heads ({k.shape[1]})"
        )
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"{op}: head dims differ: q {q.shape[3]}, k {k.shape[3]}")


def _check_block_size(op: str, block_size: object) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"{op}: block_size must be a positive int, got {block_size!r}")


def _check_scale(op: str, scale: object) -> None:
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"{op}: scale must be None or a positive number, got {scale!r}")


def _check_flag(op: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{op}: {name} must be a bool, got {type(value).__name__} {value!r}")


def _bnsd_and_scale(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """BNSD views of q, k, v and the softmax scale (default ``D ** -0.5``)."""
    qb, kb, vb = to_bnsd(q, layout), to_bnsd(k, layout), to_bnsd(v, layout)
    return qb, kb, vb, int(qb.shape[3]) ** -0.5 if scale is None else float(scale)


def _from_bnsd(out: torch.Tensor, layout: str) -> torch.Tensor:
    return out if layout == "BNSD" else out.transpose(1, 2).contiguous()


# --- estimate_block_mask ---------------------------------------------------------------


def _score_args(
    qb: torch.Tensor, block_size: int, stride: int, scale: float | None, causal: bool
) -> dict[str, Any]:
    """The block-score functions' keyword arguments for BNSD ``qb``: scores use
    ``scale / stride`` (``scale`` defaults to ``D ** -0.5``)."""
    softmax_scale = int(qb.shape[3]) ** -0.5 if scale is None else float(scale)
    return {
        "block_size": block_size,
        "stride": stride,
        "score_scale": softmax_scale / stride,
        "causal": causal,
    }


@register_op("estimate_block_mask")
class EstimateBlockMask(CustomOp):
    """Estimate a block mask from q and k. Call as ``estimate_block_mask(q, k, ...)``."""

    def forward(  # type: ignore[override]
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        *,
        layout: str = "BNSD",
        block_size: int = 128,
        stride: int = 8,
        scale: float | None = None,
        threshold: float = 1.0,
        keep_ratio: float = 1.0,
        keep_sink: bool = True,
        keep_recent: bool = True,
        causal: bool = False,
        dense_blocks: int = 0,
        forced_blocks: str = "in_budget",
        method: str = OP_DEFAULT_METHOD,
        samples: int = DEFAULT_SAMPLES,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns int8 ``mask [B, Nq, Qb, KVb]`` and int32 ``counts [B, Nq, Qb]``.

        ``keep_ratio`` in ``(0, 1]`` is the share of the block map kept per head, forced
        blocks included (``forced_blocks="in_budget"``), or sglang's reading
        (``"on_top"``): a cap on the kept share of scored blocks per row (rows of 10 or
        more candidates) with sink, recent and first-frame blocks on top.
        ``threshold`` > 0 is the cumulative mass kept before the cap (>= 1 keeps all);
        ``dense_blocks`` >= 0 leading block rows and columns are forced on (the first
        video frame). ``method``: how blocks are scored and the budget spent (one of
        :data:`ditops.attention.methods.METHODS`, default ``"antidiagonal"``, the
        XAttention estimate); ``samples``: query rows per block of the sampled scores.
        See :mod:`ditops.attention.estimate` and :mod:`ditops.attention.methods`.
        """
        op = "estimate_block_mask"
        _check_tensors(op, ("q", "k"), (q, k))
        _check_layout(op, layout)
        _check_heads(op, to_bnsd(q, layout), to_bnsd(k, layout))
        _check_block_size(op, block_size)
        if isinstance(stride, bool) or not isinstance(stride, int) or stride < 1:
            raise ValueError(f"{op}: stride must be a positive int, got {stride!r}")
        if block_size % stride:
            raise ValueError(
                f"{op}: block_size ({block_size}) must be a multiple of stride ({stride})"
            )
        _check_scale(op, scale)
        if (
            not isinstance(threshold, (int, float))
            or isinstance(threshold, bool)
            or not threshold > 0
        ):
            raise ValueError(f"{op}: threshold must be a number > 0, got {threshold!r}")
        if (
            not isinstance(keep_ratio, (int, float))
            or isinstance(keep_ratio, bool)
            or not 0 < keep_ratio <= 1
        ):
            raise ValueError(f"{op}: keep_ratio must be in (0, 1], got {keep_ratio!r}")
        for name, value in (
            ("keep_sink", keep_sink),
            ("keep_recent", keep_recent),
            ("causal", causal),
        ):
            _check_flag(op, name, value)
        if isinstance(dense_blocks, bool) or not isinstance(dense_blocks, int) or dense_blocks < 0:
            raise ValueError(f"{op}: dense_blocks must be an int >= 0, got {dense_blocks!r}")
        if forced_blocks not in FORCED_BLOCKS:
            raise ValueError(
                f"{op}: forced_blocks must be one of {FORCED_BLOCKS}, got {forced_blocks!r}"
            )
        check_method(
            method, samples, forced_blocks=forced_blocks, threshold=float(threshold), where=op
        )
        selection = {
            "threshold": float(threshold),
            "keep_ratio": float(keep_ratio),
            "keep_sink": keep_sink,
            "keep_recent": keep_recent,
            "causal": causal,
            "dense_blocks": dense_blocks,
            "forced_blocks": forced_blocks,
        }
        # Forced blocks alone fill the budget, or it is everything: no scores, on any path.
        qb_, kb_ = to_bnsd(q, layout), to_bnsd(k, layout)
        if qb_.shape[2] and kb_.shape[2]:
            without = mask_without_scores(qb_, kb_, block_size=block_size, **selection)
            if without is not None:
                return without
        return self.dispatch(
            q,
            k,
            layout=layout,
            block_size=block_size,
            stride=stride,
            scale=scale,
            method=method,
            samples=samples,
            **selection,
        )

    def forward_native(
        self, q: torch.Tensor, k: torch.Tensor, **kw: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return estimate_block_mask_reference(q, k, **kw)

    def fast_path_reasons(self, kind: str, *args: Any, **kwargs: Any) -> list[str]:
        q, k = args[0], args[1]
        layout = kwargs.get("layout", "BNSD")
        q_len, kv_len = to_bnsd(q, layout).shape[2], to_bnsd(k, layout).shape[2]
        if q_len == 0 or kv_len == 0:
            return ["empty sequence: nothing to compute"]
        cells = kwargs.get("block_size", 128) // kwargs.get("stride", 8)
        method = kwargs.get("method", OP_DEFAULT_METHOD)
        antidiagonal = METHODS[method][0] == "antidiagonal"
        if kind in ("cuda", "hip", "xpu", "npu") and not antidiagonal:
            kernel = "Triton" if kind != "npu" else "NPU"
            return [
                f"method {method!r} scores sampled query rows; the {kernel} estimate computes "
                "antidiagonal scores only (the meaning runs: plain torch on this device)"
            ]
        if kind == "npu" and METHODS[method][1] != "row":
            return [
                f"method {method!r} spends one budget per head; the NPU kernel takes a budget "
                "per row only"
            ]
        if kind == "cpu":
            if cpu_half_matmuls_slow() is None:
                return [
                    "this CPU (AVX-512 or better) multiplies bf16/fp16 natively: the "
                    "meaning, in q's dtype, is the faster"
                ]
            return []
        if kind in ("cuda", "hip", "xpu") and cells > TRITON_ESTIMATE_MAX_CELLS:
            return [
                f"block_size / stride = {cells} strided rows per block; the Triton estimate "
                f"takes at most {TRITON_ESTIMATE_MAX_CELLS}"
            ]
        if kind != "npu":
            return []
        reasons = npu.input_reasons(layout, q, k)
        reasons += npu.block_size_reasons(kwargs.get("block_size", 128), kwargs.get("stride", 8))
        if q_len != kv_len:
            # The legacy estimator takes both block dims from the query length; the current
            # one's cross-length scoring is not documented: only self-attention is sent.
            reasons.append(
                f"the NPU sparse_block_estimate is used for self-attention only; q has {q_len} "
                f"tokens, k {kv_len}"
            )
        if (
            kwargs.get("forced_blocks", "in_budget") == "in_budget"
            and kwargs.get("dense_blocks", 0) > 0
            and kwargs.get("threshold", 1.0) < 1.0
        ):
            # The kernel's threshold would count the first frame's columns' mass.
            reasons.append(
                "threshold < 1 with first-frame blocks under forced_blocks='in_budget': the "
                "NPU kernel cannot leave the first frame's columns out of the threshold"
            )
        return reasons

    @fast_path(backend=TRITON, precisions=("fast",), dtypes=_FLOATS, inference_only=True)
    def forward_cuda(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        *,
        layout: str,
        block_size: int,
        stride: int,
        scale: float | None,
        causal: bool,
        **selection: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Block scores from the Triton kernel (antidiagonal methods only, see
        ``fast_path_reasons``), then the native selection."""
        from ditops.kernels.triton.estimate import block_scores

        qb, kb = to_bnsd(q, layout), to_bnsd(k, layout)
        allocation = METHODS[selection.pop("method")][1]
        selection.pop("samples")
        scores = block_scores(qb, kb, **_score_args(qb, block_size, stride, scale, causal))
        return mask_from_scores(scores, causal=causal, allocation=allocation, **selection)

    forward_hip = forward_cuda
    forward_xpu = forward_cuda

    @fast_path(precisions=("fast",), dtypes=_HALF, inference_only=True)
    def forward_cpu(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        *,
        layout: str,
        block_size: int,
        stride: int,
        scale: float | None,
        causal: bool,
        **selection: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The meaning's block scores computed from fp32 copies of q and k, then its
        selection: for CPUs without AVX-512, whose bf16/fp16 matmuls take a fallback
        several times slower than fp32 (the estimate of a bf16 [1, 12, 8064, 128] call:
        3.2-3.4 s, 77-94% of a dense attention, on the 2-core AVX2 machine). Scores
        differ from the meaning's by its roundings (of q * scale, the scores and the
        probabilities to q's dtype): masks agree except at near-ties, as the Triton
        estimate's do. Both methods' scores (antidiagonal, sampled)."""
        qb, kb = to_bnsd(q, layout), to_bnsd(k, layout)
        kind, allocation = METHODS[selection.pop("method")]
        samples = selection.pop("samples")
        args = _score_args(qb, block_size, stride, scale, causal)
        if kind == "sampled":  # converts the sampled rows and each head's keys only
            scores = sampled_block_scores(
                qb, kb, block_size=block_size, samples=samples, causal=causal,
                scale=args["score_scale"] * stride, compute_dtype=torch.float32,
            )  # fmt: skip
        else:
            scores = native_block_scores(qb.float(), kb.float(), **args)
        return mask_from_scores(scores, causal=causal, allocation=allocation, **selection)

    @fast_path(backend=NPU_ESTIMATE, precisions=("fast",), dtypes=_HALF, inference_only=True)
    def forward_npu(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        *,
        layout: str,
        block_size: int,
        stride: int,
        scale: float | None,
        threshold: float,
        keep_ratio: float,
        keep_sink: bool,
        keep_recent: bool,
        causal: bool,
        dense_blocks: int,
        forced_blocks: str,
        method: str,
        samples: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
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
        qb, kb = to_bnsd(q, layout), to_bnsd(k, layout)
        heads, kv_heads, dim = int(qb.shape[1]), int(kb.shape[1]), int(qb.shape[3])
        softmax_scale = dim**-0.5 if scale is None else float(scale)
        kv_blocks = num_blocks(int(kb.shape[2]), block_size)
        if forced_blocks == "in_budget":
            flags = {"keep_sink": keep_sink, "keep_recent": keep_recent, "causal": causal}
            q_blocks = num_blocks(int(qb.shape[2]), block_size)
            keep_ratio = npu_in_budget_ratio(
                q_blocks, kv_blocks, keep_ratio=keep_ratio, dense_blocks=dense_blocks, **flags
            )
        mask, _counts = NPU_ESTIMATE.op()(
            q.contiguous(),
            k.contiguous(),
            actual_seq_lengths=None,
            actual_seq_lengths_kv=None,
            input_layout=layout,
            stride=stride,
            sparse_size=block_size,
            num_heads=heads,
            num_key_value_heads=kv_heads,
            scale_value=softmax_scale / stride,
            threshold=threshold,
            causal=causal,
            keep_sink=keep_sink,
            keep_recent=keep_recent,
            row_sparse=keep_ratio,
        )
        # The NPU pads the column dim to a multiple of 32; the counts must be recomputed
        # after forcing the first frame anyway.
        mask = force_dense_blocks(mask[..., :kv_blocks], dense_blocks, causal=causal)
        return mask.contiguous(), row_counts(mask)


estimate_block_mask = EstimateBlockMask()


def npu_in_budget_ratio(
    q_blocks: int,
    kv_blocks: int,
    *,
    keep_ratio: float,
    dense_blocks: int,
    keep_sink: bool,
    keep_recent: bool,
    causal: bool,
) -> float:
    """The ``row_sparse`` to give the NPU estimator for the in-budget reading.

    The kernel keeps ``int(candidates * row_sparse)`` scored blocks per row (sink and
    recent excluded, first-frame columns not), in fp32. Asked for, in every row, that
    row's in-budget share plus the first-frame columns it may spend its top-k on, it
    keeps a superset of the in-budget selection.
    """
    flags = {"keep_sink": keep_sink, "keep_recent": keep_recent, "causal": causal}
    budget = block_budget(
        q_blocks, kv_blocks, keep_ratio=keep_ratio, dense_blocks=dense_blocks, **flags
    )
    ratio = 0.0
    for r, share in enumerate(budget.per_row):
        n = min(r + 1, kv_blocks) if causal else kv_blocks
        if r < dense_blocks or n == 0:
            continue  # forced dense afterwards
        # First-frame columns the kernel scores (column 0 is the sink when kept).
        frame = max(0, min(dense_blocks, n) - (1 if keep_sink else 0))
        if keep_recent and n - 1 < dense_blocks:
            frame -= 1
        want = share + max(frame, 0)
        # The midpoint, so the kernel's fp32 floor gives ``want`` exactly.
        ratio = max(ratio, min(1.0, (want + 0.5) / n))
    return ratio if ratio > 0 else 0.5 / max(kv_blocks, 1)


# --- block_sparse_attention ------------------------------------------------------------


@register_op("block_sparse_attention")
class BlockSparseAttentionOp(CustomOp):
    """Block-sparse attention. Call as ``block_sparse_attention(q, k, v, mask, counts, ...)``."""

    # NaN/inf in q, k or v: the meaning runs (FlexAttention turns a NaN query row into
    # zeros and ignores an inf key; the meaning gives NaN as dense SDPA does).
    meaning_for_non_finite = (0, 1, 2)

    def forward(  # type: ignore[override]
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor,
        counts: torch.Tensor,
        *,
        layout: str = "BNSD",
        scale: float | None = None,
        causal: bool = False,
        block_size: int = 128,
    ) -> torch.Tensor:
        """Attention of each query block over its selected key blocks.

        ``mask``/``counts``: int8 (or bool) ``[B, Nq, Qb, >=KVb]`` and int32 ``[B, Nq, Qb]``
        row sums (:mod:`ditops.attention.block_mask`); values are checked on CPU tensors
        (elsewhere reading them would wait for the device). Returns the query's shape and
        dtype (with ``v``'s head dim).
        """
        op = "block_sparse_attention"
        _check_tensors(op, ("q", "k", "v"), (q, k, v))
        _check_layout(op, layout)
        qb, kb, vb = to_bnsd(q, layout), to_bnsd(k, layout), to_bnsd(v, layout)
        _check_heads(op, qb, kb)
        if kb.shape[:3] != vb.shape[:3]:
            raise ValueError(
                f"{op}: k and v must agree in batch, heads and length; got "
                f"{list(kb.shape)} and {list(vb.shape)} (as BNSD)"
            )
        _check_block_size(op, block_size)
        _check_scale(op, scale)
        _check_flag(op, "causal", causal)
        if isinstance(mask, torch.Tensor) and mask.device != q.device:
            raise ValueError(f"{op}: mask is on {mask.device}, q on {q.device}")
        validate_block_mask(
            mask,
            counts,
            batch=int(qb.shape[0]),
            heads=int(qb.shape[1]),
            q_blocks=num_blocks(int(qb.shape[2]), block_size),
            kv_blocks=num_blocks(int(kb.shape[2]), block_size),
            check_values=mask.device.type == "cpu" and not torch.compiler.is_compiling(),
        )
        return self.dispatch(
            q, k, v, mask, counts, layout=layout, scale=scale, causal=causal, block_size=block_size
        )

    def forward_native(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor,
        counts: torch.Tensor,
        **options: Any,
    ) -> torch.Tensor:
        # counts equal mask's row sums (checked in forward): the mask alone says it all.
        return block_sparse_attention_reference(q, k, v, mask, **options)

    def output_shape(self, *args: Any, **kwargs: Any) -> tuple[int, ...]:
        q, v = args[0], args[2]
        return (*q.shape[:-1], v.shape[-1])  # the query's shape, with v's head dim

    def fast_path_reasons(self, kind: str, *args: Any, **kwargs: Any) -> list[str]:
        q, k = args[0], args[1]
        layout = kwargs.get("layout", "BNSD")
        if to_bnsd(q, layout).shape[2] == 0 or to_bnsd(k, layout).shape[2] == 0:
            return ["empty sequence: nothing to compute"]
        if kind != "npu":
            return []
        v = args[2]
        reasons = npu.input_reasons(layout, q, k, v)
        reasons += npu.block_size_reasons(kwargs.get("block_size", 128))
        reasons += npu.attention_kernel_reasons(to_bnsd(q, layout), to_bnsd(v, layout))
        return reasons

    def _flex(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor,
        counts: torch.Tensor,
        *,
        layout: str,
        scale: float | None,
        causal: bool,
        block_size: int,
    ) -> torch.Tensor:
        from ditops.kernels.flex_attention import flex_block_sparse_attention

        qb, kb, vb, softmax_scale = _bnsd_and_scale(q, k, v, layout, scale)
        block_mask = to_flex_block_mask(
            mask,
            counts,
            q_len=int(qb.shape[2]),
            kv_len=int(kb.shape[2]),
            block_size=block_size,
            causal=causal,
        )
        out = flex_block_sparse_attention(
            qb, kb, vb, block_mask, scale=softmax_scale, needs_mask_mod=causal
        )
        return _from_bnsd(out, layout)

    # No compile: the selected key blocks are gathered and ATen's CPU flash kernel runs on
    # them (kernels/cpu/block_sparse_attention.py). Measured faster than compiled
    # FlexAttention at every keep ratio on the project CPU, see
    # benchmarks/cpu/probes/sparse_attention_cpu.py.
    @fast_path(precisions=("fast",), dtypes=_FLOATS, inference_only=True)
    def forward_cpu(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
        counts: torch.Tensor, **opts: Any,
    ) -> torch.Tensor:  # fmt: skip
        from ditops.kernels.cpu.block_sparse_attention import gathered_block_sparse_attention

        qb, kb, vb, softmax_scale = _bnsd_and_scale(q, k, v, opts["layout"], opts["scale"])
        return gathered_block_sparse_attention(
            qb, kb, vb, mask, softmax_scale, opts["causal"], opts["block_size"],
            opts["layout"] == "BSND",
        )  # fmt: skip

    # FlexAttention on a GPU generates Triton kernels.
    @fast_path(backend=TRITON, precisions=("fast",), dtypes=_FLOATS, inference_only=True)
    def forward_cuda(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._flex(*args, **kwargs)

    # ROCm builds run FlexAttention's Triton kernels too (untested here: no AMD GPU).
    forward_hip = forward_cuda

    @fast_path(backend=NPU_ATTENTION, precisions=("fast",), dtypes=_HALF, inference_only=True)
    def forward_npu(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor,
        counts: torch.Tensor,
        *,
        layout: str,
        scale: float | None,
        causal: bool,
        block_size: int,
    ) -> torch.Tensor:
        qb, kb = to_bnsd(q, layout), to_bnsd(k, layout)
        heads, kv_heads, dim = int(qb.shape[1]), int(kb.shape[1]), int(qb.shape[3])
        softmax_scale = dim**-0.5 if scale is None else float(scale)
        call = NPU_ATTENTION.resolved()
        out = call.fn(
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
            mask.to(torch.int8).contiguous(),
            counts.to(torch.int32).contiguous(),
            input_layout=layout,
            sparse_size=block_size,
            num_heads=heads,
            num_key_value_heads=kv_heads,
            scale_value=softmax_scale,
            causal=causal,
            # 0 = high precision; fp16 on sgl_kernel_npu has only 1 (high performance).
            inner_precise=npu.inner_precise(call, q.dtype),
        )
        return out.to(q.dtype)


block_sparse_attention = BlockSparseAttentionOp()


# --- the layer -------------------------------------------------------------------------


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
    _check_layout("dense_attention", layout)
    qb, kb, vb = to_bnsd(q, layout), to_bnsd(k, layout), to_bnsd(v, layout)
    out = F.scaled_dot_product_attention(
        qb, kb, vb, is_causal=causal, scale=scale, enable_gqa=qb.shape[1] != kb.shape[1]
    )
    return _from_bnsd(out, layout)


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
        if isinstance(dense_blocks, bool) or not isinstance(dense_blocks, int) or dense_blocks < 0:
            raise ValueError(f"dense_blocks must be an int >= 0, got {dense_blocks!r}")
        self.dense_blocks = dense_blocks
        self.step: int | None = None
        # Per thread (its ident), per branch: see _thread_masks.
        self._masks: dict[int, OrderedDict[str | None, _CachedMask]] = {}
        if self.config.estimate_every > 1:
            _eager_kept_or_new_mask()  # made now, before any torch.compile trace

    def set_step(self, step: int | None) -> None:
        """The denoising step index of the next calls (``None``: unknown)."""
        self.step = step

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
    "ATTENTION_TOLERANCE",
    "MAX_MASK_BRANCHES",
    "NPU_FP16_LOGIT_ATOL",
    "BlockSparseAttention",
    "BlockSparseAttentionOp",
    "EstimateBlockMask",
    "block_sparse_attention",
    "dense_attention",
    "estimate_block_mask",
]
