"""``block_sparse_attention(q, k, v, mask, counts, ...)``: softmax over the selected key blocks.

Meaning (``forward_native``): :func:`ditops.attention.reference.block_sparse_attention_reference`
(fp32, memory-bounded). Paths: ``cpu`` runs compiled FlexAttention for bf16 on long
sequences where it is measured faster (:func:`cpu_flex_reasons`: ``DITOPS_TUNE``), else
gathers the selected key blocks and runs SDPA on them (no compile:
:mod:`ditops.kernels.cpu.block_sparse_attention`);
``cuda``/``hip`` through compiled FlexAttention; ``npu`` through sgl-kernel-npu's
``ada_block_sparse_attention`` (:mod:`ditops.ops.attention_npu`: its limits are that
path's reasons). Other devices run native.

**NaN and inf** in q, k or v. On CPU such a call runs the meaning (one ``aminmax`` per
tensor, a flag in host memory; inside a compiled graph a ``torch.cond``). On an
accelerator nothing is read back (no host sync): the path runs and
:meth:`BlockSparseAttentionOp.mend_non_finite` puts NaN, on the device, where the
meaning has non-finite inputs reach the output: a query row holding one -> its output
row (rows keeping no key block output zeros, as in the meaning); a key block (at the
mask's block granularity, GQA heads expanded) holding one in k -> every row of every
query block keeping it (tiny matmuls of the mask with per-block flags); one in v at
column ``d`` -> column ``d`` of every row of the query heads reading it (the meaning
multiplies every key's probability, zero or not, by v). For NaN inputs this is the
meaning's NaN pattern (under ``causal`` a NaN key reaches its whole diagonal block,
not only the later rows). For inf it is NaN wherever the meaning is non-finite, and
also where the meaning stays finite (a key whose score is -inf just drops out of its
softmax): loud, never silent.

Precision: every fast path is ``fast`` only (``exact`` runs native). ``fast`` means within
``ATTENTION_TOLERANCE`` of native (fp32 inside, rounded once): SDPA's CPU flash kernel,
FlexAttention and the NPU kernel round softmax probabilities to the input dtype before
the second matmul, as every flash-attention kernel does. One exception: fp16 on
``sgl_kernel_npu``, which lacks the kernel's fp16 high-precision specialization, runs its
high-performance one (``inner_precise=1``), holding scores and softmax in fp16: a logit
``l`` is then off by up to ``|l| * 2**-11``, and the bound's ``atol`` grows by
``NPU_FP16_LOGIT_ATOL * max|logit|`` (bf16, and fp16 on the legacy package, take the
high-precision path).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ditops.attention.block_mask import num_blocks, to_flex_block_mask, validate_block_mask
from ditops.attention.layout import to_bnsd
from ditops.attention.reference import block_sparse_attention_reference
from ditops.backends.inductor_cpu import INDUCTOR_CPU, amx_tiles
from ditops.backends.triton import TRITON
from ditops.core import tune
from ditops.core.checks import FLOATS, HALF, check_flag
from ditops.core.op import CustomOp, register_op
from ditops.core.paths import path
from ditops.core.public import public_op
from ditops.ops.attention_args import (
    AttentionCall,
    check_block_size,
    check_heads,
    check_layout,
    check_qkv,
    check_scale,
    from_bnsd,
    softmax_scale,
)
from ditops.ops.attention_npu import NPU_ATTENTION, attention_reasons, npu_attention
from ditops.platform import device_kind
from ditops.tracing import traced

#: ``fast`` tolerance of block_sparse_attention against native, per output dtype:
#: ``|out - native| <= atol * max|v| + rtol * |native|`` (about 1 ulp of max|v| in bf16;
#: the errors measured on CPU FlexAttention and the CPU gathered-SDPA path are recorded
#: in benchmarks/cpu/probes/sparse_attention_cpu.py).
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

#: Shortest query sequence for which CPUs run compiled FlexAttention: compiling a new
#: shape takes seconds (5-10 s on 2 cores), which pays off on video-length sequences
#: only; shorter ones take the gathered-SDPA path, which compiles nothing.
CPU_FLEX_MIN_TOKENS = 4096


def _blocks_with_non_finite(t: torch.Tensor, block_size: int, blocks: int) -> torch.Tensor:
    """BNSD ``t`` -> bool ``[B, N, blocks, D]``: which (block, column) holds a NaN/inf."""
    bad = ~t.isfinite()
    pad = blocks * block_size - int(t.shape[2])
    if pad:
        bad = F.pad(bad, (0, 0, 0, pad))
    return bad.reshape(*bad.shape[:2], blocks, block_size, bad.shape[3]).any(3)


def cpu_flex_reasons(c: AttentionCall) -> list[str]:
    """Why compiled FlexAttention does not serve this CPU call (the gathered path does).

    Which of the two is faster depends on the CPU, so with ``DITOPS_TUNE=on`` the tuner
    times both on the first call of each shape class (:mod:`ditops.core.tune`; the
    compile, seconds, is part of that first call) and keeps the faster. Without a
    measurement a static rule stands in, written from these: bf16 ``[1, 12, 8064, 128]``
    on the estimator's masks, keep 0.25, FlexAttention against the gathered path: 2.0x vs
    1.2x dense SDPA on a 2-core Xeon with AMX (``benchmarks/cpu/probes/sparse_kernel_wan.txt``),
    2.46x vs 1.47x on an AVX-512 EPYC with AVX-512-BF16 and no AMX
    (``benchmarks/cpu/sparse_tuned.txt``), 1.5x vs 2.5x on an AVX2 EPYC
    (``sparse_attention_cpu.txt``). Short sequences never take it, tuned or not: a
    compile per shape (seconds) pays off on video-length sequences only, and the tuner
    compiles nothing for them.
    """
    if traced():  # first: nothing below is traced
        return ["inside torch.compile the gathered path (one opaque op) is traced"]
    reasons = []
    if not tune.deciding() and not (amx_tiles() or "avx512_bf16" in tune.cpu_flags()):
        reasons.append(
            "no AMX or AVX-512-BF16 on this CPU: the gathered-SDPA path is faster here "
            "(a static rule; DITOPS_TUNE=on measures instead)"
        )
    q_len = int(c.qb.shape[2])
    if q_len < CPU_FLEX_MIN_TOKENS:
        reasons.append(
            f"{q_len} query tokens < CPU_FLEX_MIN_TOKENS={CPU_FLEX_MIN_TOKENS}: compiling "
            "FlexAttention per shape (seconds) pays off on long sequences only"
        )
    return reasons


@register_op("block_sparse_attention")
class BlockSparseAttentionOp(CustomOp):
    """Block-sparse attention. Call as ``block_sparse_attention(q, k, v, mask, counts, ...)``."""

    # FlexAttention turns a NaN query row into zeros and ignores an inf key; the meaning
    # gives NaN as dense SDPA does. See the module docstring.
    non_finite_inputs = ("q", "k", "v")
    # The meaning is an fp32, memory-bounded oracle (seconds at video lengths): the tuner
    # times the paths against each other, never against it.
    meaning_competes = False

    def prepare(  # type: ignore[override]
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
    ) -> AttentionCall:
        """Attention of each query block over its selected key blocks.

        ``mask``/``counts``: int8 (or bool) ``[B, Nq, Qb, >=KVb]`` and int32 ``[B, Nq, Qb]``
        row sums (:mod:`ditops.attention.block_mask`); values are checked on CPU tensors
        (elsewhere reading them would wait for the device). Returns the query's shape and
        dtype (with ``v``'s head dim).
        """
        op = "block_sparse_attention"
        check_qkv(op, ("q", "k", "v"), (q, k, v))
        layout = check_layout(op, layout)
        qb, kb, vb = to_bnsd(q, layout), to_bnsd(k, layout), to_bnsd(v, layout)
        check_heads(op, qb, kb)
        if kb.shape[:3] != vb.shape[:3]:
            raise ValueError(
                f"{op}: k and v must agree in batch, heads and length; got "
                f"{list(kb.shape)} and {list(vb.shape)} (as BNSD)"
            )
        block_size = check_block_size(op, block_size)
        scale = check_scale(op, scale)
        check_flag(op, "causal", causal)
        if isinstance(mask, torch.Tensor) and mask.device != q.device:
            raise ValueError(f"{op}: mask is on {mask.device}, q on {q.device}")
        validate_block_mask(
            mask,
            counts,
            batch=int(qb.shape[0]),
            heads=int(qb.shape[1]),
            q_blocks=num_blocks(int(qb.shape[2]), block_size),
            kv_blocks=num_blocks(int(kb.shape[2]), block_size),
            check_values=device_kind(mask) == "cpu" and not traced(),
        )
        return AttentionCall(q, k, v, mask, counts, layout, scale, causal, block_size)

    def forward_native(self, c: AttentionCall) -> torch.Tensor:
        # counts equal mask's row sums (checked in prepare): the mask alone says it all.
        return block_sparse_attention_reference(
            c.q,
            c.k,
            c.v,
            c.mask,
            layout=c.layout,
            scale=c.scale,
            causal=c.causal,
            block_size=c.block_size,
        )

    def not_supported(self, c: AttentionCall) -> list[str]:
        if c.qb.shape[2] == 0 or c.kb.shape[2] == 0:
            return ["empty sequence: nothing to compute"]
        return []

    def output_shape(self, c: AttentionCall) -> tuple[int, ...]:
        return (*c.q.shape[:-1], c.v.shape[-1])  # the query's shape, with v's head dim

    def mend_non_finite(self, c: AttentionCall, out: torch.Tensor) -> torch.Tensor:
        """NaN where non-finite q, k, v reach ``out`` in the meaning, on the device (no
        value read back; see the module docstring)."""
        qb, kb, vb = c.qb, c.kb, c.vb
        heads, q_len = int(qb.shape[1]), int(qb.shape[2])
        group = heads // int(kb.shape[1])
        bs = c.block_size
        kv_blocks = num_blocks(int(kb.shape[2]), bs)
        keep = c.mask[..., :kv_blocks].to(torch.float32)  # [B, N, Qb, KVb]
        k_bad = _blocks_with_non_finite(kb, bs, kv_blocks).any(-1, keepdim=True)
        v_bad = ~vb.isfinite().all(2, keepdim=True)  # [B, Nkv, 1, Dv]
        if group > 1:
            k_bad = k_bad.repeat_interleave(group, dim=1)
            v_bad = v_bad.repeat_interleave(group, dim=1)
        k_reached = torch.matmul(keep, k_bad.to(torch.float32)) > 0  # [B, N, Qb, 1]
        any_kept = keep.sum(-1, keepdim=True) > 0  # a row without keys outputs zeros
        q_row = ~qb.isfinite().all(-1, keepdim=True)  # [B, N, Sq, 1]
        rows = (k_reached.repeat_interleave(bs, dim=2)[:, :, :q_len]) | (
            q_row & any_kept.repeat_interleave(bs, dim=2)[:, :, :q_len]
        )
        bad = rows | v_bad  # [B, N, Sq, Dv]
        if c.layout != "BNSD":
            bad = bad.transpose(1, 2)
        return out.masked_fill(bad, float("nan"))

    def _flex(self, c: AttentionCall) -> torch.Tensor:
        from ditops.kernels.flex_attention import flex_block_sparse_attention

        qb, kb = c.qb, c.kb
        block_mask = to_flex_block_mask(
            c.mask,
            c.counts,
            q_len=int(qb.shape[2]),
            kv_len=int(kb.shape[2]),
            block_size=c.block_size,
            causal=c.causal,
        )
        out = flex_block_sparse_attention(
            qb, kb, c.vb, block_mask, scale=softmax_scale(qb, c.scale), needs_mask_mod=c.causal
        )
        return from_bnsd(out, c.layout)

    # On CPU: bf16, long sequences, measured or ruled faster (cpu_flex_reasons). Not fp16:
    # without AMX-FP16 (newer Xeons only) flex ran 0.82x dense there, gathered 2.49x.
    @path(
        "cpu",
        backend=INDUCTOR_CPU,
        dtypes=(torch.bfloat16,),
        inference_only=True,
        reasons=cpu_flex_reasons,
    )
    def forward_cpu_flex(self, c: AttentionCall) -> torch.Tensor:
        return self._flex(c)

    # No compile: the selected key blocks are gathered and ATen's CPU flash kernel runs on
    # them (kernels/cpu/block_sparse_attention.py); against compiled FlexAttention see
    # benchmarks/cpu/probes/sparse_kernel_wan.py.
    @path(dtypes=FLOATS, inference_only=True)
    def forward_cpu(self, c: AttentionCall) -> torch.Tensor:
        from ditops.kernels.cpu.block_sparse_attention import gathered_block_sparse_attention

        return gathered_block_sparse_attention(
            c.qb,
            c.kb,
            c.vb,
            c.mask,
            softmax_scale(c.qb, c.scale),
            c.causal,
            c.block_size,
            c.layout == "BSND",
        )

    # FlexAttention on a GPU generates Triton kernels; ROCm builds run them too
    # (untested here: no AMD GPU).
    @path("cuda", "hip", backend=TRITON, dtypes=FLOATS, inference_only=True)
    def forward_cuda(self, c: AttentionCall) -> torch.Tensor:
        return self._flex(c)

    @path(backend=NPU_ATTENTION, dtypes=HALF, inference_only=True, reasons=attention_reasons)
    def forward_npu(self, c: AttentionCall) -> torch.Tensor:
        return npu_attention(c)


@public_op(BlockSparseAttentionOp())
def block_sparse_attention(
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
    """Attention of each query block over its selected key blocks only.

    Meaning: :func:`ditops.attention.reference.block_sparse_attention_reference`: for each
    query block, softmax of ``q @ k.T * scale`` over the keys of the blocks ``mask`` keeps
    (in fp32, rounded once), times v. A query block keeping no key block outputs zeros.

    Shapes and dtypes:
        q, k, v: ``[B, N, S, D]`` (``layout="BNSD"``) or ``[B, S, N, D]`` (``"BSND"``),
            fp32/bf16/fp16, one dtype; k and v may have fewer heads (GQA) and v its own D.
        mask: int8 or bool ``[B, N, Qb, >=KVb]``, 1 where a key block is kept (as
            :func:`estimate_block_mask` returns).
        counts: int32 ``[B, N, Qb]``, the number of kept blocks per row (checked against
            the mask on CPU tensors; elsewhere reading it would wait for the device).
        layout: ``"BNSD"`` or ``"BSND"``.
        scale: the softmax scale (None: ``D ** -0.5``).
        causal: keys after a query are masked too.
        block_size: tokens per block of the mask (the NPU kernels: a multiple of 128).

    Returns q's shape (with v's head dim) and dtype.

    Precision: fast paths are ``fast`` only (``exact`` runs the meaning): within
    ``ATTENTION_TOLERANCE`` of the meaning (about 1 ulp of ``max|v|``), as flash kernels
    round probabilities before the second matmul. NaN and inf in q, k or v reach the output
    where the meaning puts them (on CPU the meaning runs such a call; on accelerators the
    output is mended on the device, no host sync).
    """
