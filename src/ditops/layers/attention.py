"""Adaptive block-sparse attention: mask estimation, sparse attention, and the layer.

Two ops, each a registered CustomOp with a functional entry point of the same name:

- ``estimate_block_mask(q, k, ...) -> (mask, counts)``: the XAttention-style estimate
  of :mod:`ditops.attention.estimate`. Paths: native (plain torch, every device);
  ``npu`` through ``torch.ops.attentions.sparse_block_estimate`` followed by the same
  first-frame forcing and count recomputation.
- ``block_sparse_attention(q, k, v, mask, counts, ...)``: softmax over the union of the
  selected key blocks (:mod:`ditops.attention.reference` is the meaning). Paths:
  native (fp32, memory-bounded); ``cpu`` gathers the selected key blocks and runs SDPA
  on them (no compile); ``cuda``/``hip`` through compiled FlexAttention;
  ``npu`` through ``torch.ops.attentions.ada_block_sparse_attention`` (or its older
  name ``block_sparse_attention``). Other devices run native.

Precision: every fast path is ``fast`` only (``exact`` runs native). For attention,
``fast`` means within ``ATTENTION_TOLERANCE`` of native (fp32 inside, rounded once):
SDPA's CPU flash kernel, FlexAttention and the NPU kernel round softmax probabilities
to the input dtype before the second matmul, as every flash-attention kernel does. For
the estimate, ``fast`` means the NPU's fp16 block scores may break near-ties differently.

:class:`BlockSparseAttention` puts both behind a schedule
(:class:`ditops.attention.schedule.BlockSparseConfig`): dense SDPA for the first
denoising steps and at sparsity 0, estimate + sparse attention after.
"""

from __future__ import annotations

from collections.abc import Sequence
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
from ditops.attention.estimate import estimate_block_mask_reference, force_dense_blocks
from ditops.attention.layout import LAYOUTS, to_bnsd
from ditops.attention.reference import block_sparse_attention_reference
from ditops.attention.schedule import BlockSparseConfig, first_frame_dense_blocks
from ditops.backends.npu import attentions_op
from ditops.backends.triton import TRITON
from ditops.custom_op import CustomOp, fast_path, register_op

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_HALF = (torch.bfloat16, torch.float16)
NPU_ESTIMATE = attentions_op("sparse_block_estimate")
NPU_ATTENTION = attentions_op("ada_block_sparse_attention", "block_sparse_attention")
# ada_block_sparse_attention's inner_precise: 0 = high precision (bf16 always is).
_NPU_HIGH_PRECISION = 0

#: ``fast`` tolerance of block_sparse_attention against native, per output dtype:
#: ``|out - native| <= atol * max|v| + rtol * |native|`` (about 1 ulp of max|v| in bf16;
#: measured on CPU FlexAttention: bf16 2e-3, fp16 2e-4, fp32 2e-7 of max|v|; the CPU
#: gathered-SDPA path: bf16 0.8e-3 to 3e-3, fp32 6e-8).
ATTENTION_TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (8e-3, 8e-3),
    torch.float16: (1e-3, 1e-3),
}


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
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns int8 ``mask [B, Nq, Qb, KVb]`` and int32 ``counts [B, Nq, Qb]``.

        ``keep_ratio`` in ``(0, 1]`` caps the kept share of scored blocks per row (rows
        of 10 or more candidates); ``threshold`` > 0 is the cumulative mass kept before
        the cap (>= 1 keeps all); ``dense_blocks`` >= 0 leading block rows and columns
        are forced on (the first video frame). See :mod:`ditops.attention.estimate`.
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
        return self.dispatch(
            q,
            k,
            layout=layout,
            block_size=block_size,
            stride=stride,
            scale=scale,
            threshold=float(threshold),
            keep_ratio=float(keep_ratio),
            keep_sink=keep_sink,
            keep_recent=keep_recent,
            causal=causal,
            dense_blocks=dense_blocks,
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
        if kind == "npu" and q_len != kv_len:
            return [
                f"attentions.sparse_block_estimate assumes self-attention; q has {q_len} "
                f"tokens, k {kv_len}"
            ]
        return []

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
    ) -> tuple[torch.Tensor, torch.Tensor]:
        qb, kb = to_bnsd(q, layout), to_bnsd(k, layout)
        heads, kv_heads, dim = int(qb.shape[1]), int(kb.shape[1]), int(qb.shape[3])
        softmax_scale = dim**-0.5 if scale is None else float(scale)
        mask, _counts = NPU_ESTIMATE.op()(
            q,
            k,
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
        kv_blocks = num_blocks(int(kb.shape[2]), block_size)
        mask = force_dense_blocks(mask[..., :kv_blocks], dense_blocks, causal=causal)
        return mask.contiguous(), row_counts(mask)


estimate_block_mask = EstimateBlockMask()


# --- block_sparse_attention ------------------------------------------------------------


@register_op("block_sparse_attention")
class BlockSparseAttentionOp(CustomOp):
    """Block-sparse attention. Call as ``block_sparse_attention(q, k, v, mask, counts, ...)``."""

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

    def fast_path_reasons(self, kind: str, *args: Any, **kwargs: Any) -> list[str]:
        q, k = args[0], args[1]
        layout = kwargs.get("layout", "BNSD")
        if to_bnsd(q, layout).shape[2] == 0 or to_bnsd(k, layout).shape[2] == 0:
            return ["empty sequence: nothing to compute"]
        return []

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
        out = NPU_ATTENTION.op()(
            q,
            k,
            v,
            mask.to(torch.int8),
            counts.to(torch.int32),
            input_layout=layout,
            sparse_size=block_size,
            num_heads=heads,
            num_key_value_heads=kv_heads,
            scale_value=softmax_scale,
            causal=causal,
            inner_precise=_NPU_HIGH_PRECISION,
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


class BlockSparseAttention(nn.Module):
    """Adaptive block-sparse attention with a denoising schedule.

    Each call, unless the schedule says dense (sparsity 0, or a step before
    ``skip_first_steps``), estimates a block mask from q and k
    (:data:`estimate_block_mask`) and runs :data:`block_sparse_attention` with it;
    dense calls run SDPA. The first video frame's blocks are kept dense once
    :meth:`set_video_shape` (or ``dense_blocks``) says how many there are.

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

    def set_step(self, step: int | None) -> None:
        """The denoising step index of the next calls (``None``: unknown)."""
        self.step = step

    def set_video_shape(self, latent_shape: Sequence[int], patch_size: int | Sequence[int]) -> None:
        """Keep the first frame dense: ``ceil(frame_tokens / block_size)`` blocks."""
        self.dense_blocks = first_frame_dense_blocks(
            latent_shape, patch_size, self.config.block_size
        )

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
    ) -> torch.Tensor:
        """Attention of q over k/v in ``layout``; ``step`` overrides :meth:`set_step`."""
        cfg = self.config
        if cfg.dense_at(self.step if step is None else step):
            return dense_attention(q, k, v, layout=layout, scale=scale, causal=cfg.causal)
        mask, counts = estimate_block_mask(
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
            dense_blocks=self.dense_blocks,
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


__all__ = [
    "ATTENTION_TOLERANCE",
    "BlockSparseAttention",
    "BlockSparseAttentionOp",
    "EstimateBlockMask",
    "block_sparse_attention",
    "dense_attention",
    "estimate_block_mask",
]
