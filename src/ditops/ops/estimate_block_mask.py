"""``estimate_block_mask(q, k, ...) -> (mask, counts)``: a block mask from q and k.

Meaning (``forward_native``): the XAttention-style estimate of
:func:`ditops.attention.estimate.estimate_block_mask_reference`; the selection settings
travel as one :class:`ditops.attention.selection.BlockSelection`.

Paths: ``cpu`` (bf16/fp16: on CPUs without AVX-512, the meaning's scores from fp32
copies; the sampled methods' scores in fp32 by matmul and softmax on any CPU without
AMX, :func:`ditops.attention.methods.sampled_block_scores_fp32`, one head per worker
thread: :mod:`ditops.kernels.cpu.sampled_scores`);
``cuda``/``hip``/``xpu`` through a Triton kernel for the block scores
(:mod:`ditops.kernels.triton.estimate`) followed by the native selection
(:func:`ditops.attention.estimate.mask_from_scores`); ``npu`` through sgl-kernel-npu's
``sparse_block_estimate`` followed by the same first-frame forcing and count
recomputation (:mod:`ditops.ops.attention_npu`).

Precision: every path is ``fast`` only (``exact`` runs native): the NPU's fp16 block
scores, or the Triton kernel's (within a few ulps of the input dtype of native's), may
break near-ties differently.
"""

from __future__ import annotations

import torch

from ditops.attention.estimate import block_scores as native_block_scores
from ditops.attention.estimate import estimate_block_mask_reference, mask_from_scores
from ditops.attention.layout import to_bnsd
from ditops.attention.methods import (
    DEFAULT_SAMPLES,
    OP_DEFAULT_METHOD,
    sampled_block_scores_fp32,
    sampled_rows_fp32,
)
from ditops.attention.selection import BlockSelection, mask_without_scores
from ditops.backends.inductor_cpu import amx_tiles
from ditops.backends.triton import TRITON
from ditops.core.checks import FLOATS, HALF, check_int
from ditops.core.op import CustomOp, register_op
from ditops.core.paths import path
from ditops.core.public import public_op
from ditops.ops.attention_args import (
    EstimateCall,
    check_block_size,
    check_heads,
    check_layout,
    check_qkv,
    check_scale,
)
from ditops.ops.attention_npu import NPU_ESTIMATE, estimate_reasons, npu_estimate
from ditops.platform import cpu_half_matmuls_slow
from ditops.tracing import traced

#: The Triton estimate holds whole blocks in a tile: at most this many strided rows per
#: block (``block_size / stride``); larger tiles would not fit a GPU's registers.
TRITON_ESTIMATE_MAX_CELLS = 128


def cpu_estimate_reasons(c: EstimateCall) -> list[str]:
    if c.sel.scoring == "sampled":
        if amx_tiles():
            return [
                "this CPU has AMX tiles: the meaning's bf16/fp16 flash attention serves "
                "the sampled scores (the fp32 matmul form was measured faster without AMX)"
            ]
        return []
    if cpu_half_matmuls_slow() is None:
        return [
            "this CPU (AVX-512 or better) multiplies bf16/fp16 natively: the "
            "meaning, in q's dtype, is the faster"
        ]
    return []


def triton_estimate_reasons(c: EstimateCall) -> list[str]:
    if c.sel.scoring != "antidiagonal":
        return [
            f"method {c.sel.method!r} scores sampled query rows; the Triton estimate computes "
            "antidiagonal scores only (the meaning runs: plain torch on this device)"
        ]
    cells = c.block_size // c.stride
    if cells > TRITON_ESTIMATE_MAX_CELLS:
        return [
            f"block_size / stride = {cells} strided rows per block; the Triton estimate "
            f"takes at most {TRITON_ESTIMATE_MAX_CELLS}"
        ]
    return []


@register_op("estimate_block_mask")
class EstimateBlockMask(CustomOp):
    """Estimate a block mask from q and k. Call as ``estimate_block_mask(q, k, ...)``."""

    #: Where near-ties break is the path's choice: a small call keeps the path's mask.
    small_calls_run_meaning = False

    def prepare(  # type: ignore[override]
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        *,
        layout: str = "BNSD",
        block_size: int = 128,
        stride: int = 8,
        scale: float | None = None,
        threshold: float = 1.0,
        keep_ratio: float | None = None,
        keep_sink: bool = True,
        keep_recent: bool = True,
        causal: bool = False,
        dense_blocks: int = 0,
        forced_blocks: str = "in_budget",
        method: str = OP_DEFAULT_METHOD,
        samples: int = DEFAULT_SAMPLES,
        mass: float | None = None,
    ) -> EstimateCall:
        """Returns int8 ``mask [B, Nq, Qb, KVb]`` and int32 ``counts [B, Nq, Qb]``.

        ``keep_ratio`` in ``(0, 1]`` is the share of the block map kept per head, forced
        blocks included (``forced_blocks="in_budget"``), or sglang's reading
        (``"on_top"``): a cap on the kept share of scored blocks per row (rows of 10 or
        more candidates) with sink, recent and first-frame blocks on top.
        Default 1 (every block), unless ``mass`` is given: in ``(0, 1]``, the share of
        each row's estimated attention mass (per-row methods), or of each head's on
        average over its rows (per-head methods), the kept blocks cover, forced blocks
        counted (:func:`ditops.attention.mass.select_by_mass`): the density is then
        whatever each row or head needs (``density_stats`` of the mask returned is the
        density that runs). Give ``keep_ratio`` or ``mass``, not both.
        ``threshold`` > 0 is the cumulative mass kept before the cap (>= 1 keeps all);
        ``dense_blocks`` >= 0 leading block rows and columns are forced on (the first
        video frame). ``method``: how blocks are scored and the budget spent (one of
        :data:`ditops.attention.methods.METHODS`, default ``"antidiagonal"``, the
        XAttention estimate); ``samples``: query rows per block of the sampled scores.
        See :mod:`ditops.attention.estimate` and :mod:`ditops.attention.methods`.
        """
        op = "estimate_block_mask"
        check_qkv(op, ("q", "k"), (q, k))
        layout = check_layout(op, layout)
        qb, kb = to_bnsd(q, layout), to_bnsd(k, layout)
        check_heads(op, qb, kb)
        block_size = check_block_size(op, block_size)
        stride = check_int(op, "stride", stride)
        if block_size % stride:
            raise ValueError(
                f"{op}: block_size ({block_size}) must be a multiple of stride ({stride})"
            )
        scale = check_scale(op, scale)
        if mass is not None and keep_ratio is not None:
            raise ValueError(
                f"{op}: give keep_ratio (a density) or mass (a covered share of attention "
                f"mass), not both (got keep_ratio={keep_ratio!r}, mass={mass!r})"
            )
        sel = BlockSelection(
            threshold=threshold,
            keep_ratio=1.0 if keep_ratio is None else keep_ratio,
            mass=mass,
            keep_sink=keep_sink,
            keep_recent=keep_recent,
            causal=causal,
            dense_blocks=dense_blocks,
            forced_blocks=forced_blocks,
            method=method,
            samples=samples,
            where=op,
        )
        return EstimateCall(q, k, qb, kb, layout, block_size, stride, scale, sel)

    def answer_without_paths(self, c: EstimateCall) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Forced blocks alone fill the budget, or it is everything: no scores, on any path."""
        if c.qb.shape[2] and c.kb.shape[2]:
            return mask_without_scores(c.qb, c.kb, c.sel, block_size=c.block_size)
        return None

    def not_supported(self, c: EstimateCall) -> list[str]:
        if c.qb.shape[2] == 0 or c.kb.shape[2] == 0:
            return ["empty sequence: nothing to compute"]
        return []

    def forward_native(self, c: EstimateCall) -> tuple[torch.Tensor, torch.Tensor]:
        return estimate_block_mask_reference(
            c.q,
            c.k,
            c.sel,
            layout=c.layout,
            block_size=c.block_size,
            stride=c.stride,
            scale=c.scale,
        )

    @path(dtypes=HALF, inference_only=True, reasons=cpu_estimate_reasons)
    def forward_cpu(self, c: EstimateCall) -> tuple[torch.Tensor, torch.Tensor]:
        """The meaning's block scores computed in fp32, then its selection. Antidiagonal
        scores from fp32 copies of q and k, for CPUs without AVX-512, whose bf16/fp16
        matmuls take a fallback several times slower than fp32 (measured in
        benchmarks/cpu/probes/estimate_cost.py). Sampled scores by fp32 matmul and softmax
        (:func:`ditops.attention.methods.sampled_block_scores_fp32`) on any CPU without
        AMX: exact to fp32, and on an AVX-512 EPYC 0.62-0.67x the time of the meaning's
        bf16 flash attention on one thread, 0.71x on two (slower on two sharing their
        cores with another process; benchmarks/cpu/probes/permute_cost.txt). Scores
        differ from the meaning's by its roundings (of q * scale, the scores and the
        probabilities or masses to q's dtype): masks agree except at near-ties, as the
        Triton estimate's do."""
        sel = c.sel
        if sel.scoring == "sampled":  # converts the sampled rows and each head's keys only
            from ditops.kernels.cpu import sampled_scores

            kv_len = int(c.kb.shape[2])
            qs, allowed = sampled_rows_fp32(
                c.qb,
                kv_len,
                block_size=c.block_size,
                samples=sel.samples,
                scale=c.score_scale() * c.stride,
                causal=sel.causal,
            )
            if traced():  # traced: the 2-D form (no worker threads)
                scores = sampled_block_scores_fp32(
                    c.qb,
                    c.kb,
                    block_size=c.block_size,
                    samples=sel.samples,
                    causal=sel.causal,
                    scale=c.score_scale() * c.stride,
                )
                return mask_from_scores(scores, sel)
            # The same arithmetic as sampled_block_scores_fp32, one head per worker.
            scores = sampled_scores.sampled_block_scores_fp32(
                qs,
                c.kb,
                allowed,
                block_size=c.block_size,
                samples=sel.samples,
                kv_blocks=-(-kv_len // c.block_size),
            )
        else:
            scores = native_block_scores(
                c.qb.float(),
                c.kb.float(),
                block_size=c.block_size,
                stride=c.stride,
                score_scale=c.score_scale(),
                causal=sel.causal,
            )
        if traced():
            return mask_from_scores(scores, sel)
        from ditops.kernels.cpu.blocks import kernel_threads

        # Dozens of small ops on [B, N, Qb, KVb]: on one thread, as each 2-thread region
        # waits for a descheduled partner under load (380 ms vs 2.4 ms at load 9:
        # benchmarks/cpu/probes/estimate_workers.txt); the same bits (below ATen's grain).
        with kernel_threads(1):
            return mask_from_scores(scores, sel)

    @path(
        "cuda",
        "hip",
        "xpu",
        backend=TRITON,
        dtypes=FLOATS,
        inference_only=True,
        reasons=triton_estimate_reasons,
    )
    def forward_cuda(self, c: EstimateCall) -> tuple[torch.Tensor, torch.Tensor]:
        """Block scores from the Triton kernel (antidiagonal methods only), then the
        native selection."""
        from ditops.kernels.triton.estimate import block_scores

        scores = block_scores(
            c.qb,
            c.kb,
            block_size=c.block_size,
            stride=c.stride,
            score_scale=c.score_scale(),
            causal=c.sel.causal,
        )
        return mask_from_scores(scores, c.sel)

    @path(backend=NPU_ESTIMATE, dtypes=HALF, inference_only=True, reasons=estimate_reasons)
    def forward_npu(self, c: EstimateCall) -> tuple[torch.Tensor, torch.Tensor]:
        return npu_estimate(c)


@public_op(EstimateBlockMask())
def estimate_block_mask(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    layout: str = "BNSD",
    block_size: int = 128,
    stride: int = 8,
    scale: float | None = None,
    threshold: float = 1.0,
    keep_ratio: float | None = None,
    keep_sink: bool = True,
    keep_recent: bool = True,
    causal: bool = False,
    dense_blocks: int = 0,
    forced_blocks: str = "in_budget",
    method: str = OP_DEFAULT_METHOD,
    samples: int = DEFAULT_SAMPLES,
    mass: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A block mask for block-sparse attention, estimated from q and k.

    Meaning: :func:`ditops.attention.estimate.estimate_block_mask_reference`: score every
    (query block, key block) pair cheaply, then keep the best blocks within a budget. With
    ``method="antidiagonal"`` (XAttention) the scores are strided antidiagonal sums of
    ``q @ k.T * scale``; with ``"sampled"`` a few query rows per block attend exactly
    (``samples`` of them); other methods: :data:`ditops.attention.methods.METHODS`.

    Shapes and dtypes:
        q, k: ``[B, N, S, D]`` (``layout="BNSD"``) or ``[B, S, N, D]`` (``"BSND"``),
            fp32/bf16/fp16; k may have fewer heads (GQA) and its own length.
        layout: ``"BNSD"`` or ``"BSND"``.
        block_size: tokens per block, a positive int (128 on most kernels).
        stride: the antidiagonal stride, dividing ``block_size``.
        scale: the softmax scale (None: ``D ** -0.5``).
        threshold: cumulative share of each row's mass kept before the cap, > 0
            (>= 1 keeps everything the cap allows).
        keep_ratio: in ``(0, 1]``: the share of the block map kept per head, forced blocks
            included (``forced_blocks="in_budget"``), or sglang's per-row cap on scored
            blocks with forced blocks on top (``"on_top"``). Default (None): 1, every
            block, unless ``mass`` is given.
        keep_sink, keep_recent: force the first key block / the diagonal block on.
        causal: score only keys at or before each query.
        dense_blocks: leading block rows and columns forced on (the first video frame).
        forced_blocks: ``"in_budget"`` or ``"on_top"`` (see ``keep_ratio``).
        method: how blocks are scored and the budget spent.
        samples: query rows per block of the sampled methods.
        mass: instead of ``keep_ratio``, in ``(0, 1]``: the share of each row's estimated
            attention mass (per-row methods; each head's on average over its rows for the
            ``*_head`` methods) the kept blocks cover, forced blocks counted; the density
            is then what the scores need (``density_stats`` of the mask). Not with
            ``keep_ratio``, ``threshold < 1``, ``"on_top"`` or ``"sampled_layer"``.

    Returns ``(mask, counts)``: int8 ``[B, N, Qb, KVb]`` (1: the key block is kept) and
    int32 ``[B, N, Qb]``, each row's kept blocks; ``Qb = ceil(Sq / block_size)``,
    ``KVb = ceil(Skv / block_size)``. Pass both to :func:`block_sparse_attention`.

    Precision: every fast path is ``fast`` only (``exact`` runs the meaning): their block
    scores may differ by a few ulps of the input dtype, so near-ties can break the other
    way; the density asked is the density returned (with ``mass``: the coverage asked is
    reached on the path's own scores).
    """
