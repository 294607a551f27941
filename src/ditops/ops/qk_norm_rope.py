"""The attention prologue: RMSNorm of queries and keys, rotary embedding, and both fused.

In every DiT attention block q and k are normalised, then rotated, before attention.
Three ops, each with the literal eager code as its meaning (``forward_native``):

``rms_norm(x, weight=None, eps=None, convention="torch")``
    RMSNorm over the last dim. Two conventions, because the two RMSNorms diffusers
    models use round in different places:

    * ``"torch"``: ``torch.nn.RMSNorm`` / ``F.rms_norm`` (Wan's and FLUX's ``norm_q`` and
      ``norm_k``). In torch 2.13: ``x32 = x.float()``; ``r = rsqrt(x32.pow(2).mean(-1) +
      eps)`` in fp32; ``x32 * r``, times the weight in fp32 (a bf16/fp16 weight is widened
      exactly); rounded **once** to x's dtype. The output has x's dtype whatever the
      weight's. ``eps=None`` is fp32's machine epsilon. (Older torch releases rounded
      before the weight; the fast paths check which arithmetic the running torch has,
      :func:`torch_rms_norm_is_known`, and run the meaning when it is not this one.)
    * ``"diffusers"``: ``diffusers.models.normalization.RMSNorm``, without its bias (what
      diffusers' ``Attention(qk_norm="rms_norm")`` holds: HunyuanVideo, Lumina2): the
      same fp32 ``x32 * r``, then without a weight rounded to x's dtype; with a bf16/fp16
      weight rounded to the **weight's** dtype and multiplied by the weight in that
      dtype (a second rounding; the output has the weight's dtype); with an fp32 weight
      multiplied in fp32 and **not** rounded back (the output is fp32).

``rotary_embedding(x, cos, sin, layout="interleaved")``
    ``out = x * cos + rotate(x) * sin``, every product and the sum computed in
    ``promote_types(x.dtype, cos.dtype)`` (fp32 for fp32 tables) and rounded once to x's
    dtype. ``rotate`` maps a pair ``(x1, x2)`` to ``(-x2, x1)``; pairs are ``(x[2i],
    x[2i+1])`` (``"interleaved"``) or ``(x[i], x[i + D/2])`` (``"halves"``). x is ``[B, L, H,
    D]``; cos/sin are ``[L, Dt]`` or ``[Bt, L, 1, Dt]``, fp32 or x's dtype, with ``Dt = D``
    (one entry per element) or ``D/2`` (one angle per pair). This is, bit for bit:

    * diffusers' ``apply_rotary_emb(x, (cos, sin), use_real_unbind_dim=-1 or -2,
      sequence_dim=1)`` (FLUX, CogVideoX; Stable Audio, CogView4, Cosmos) with fp32 tables
      (it computes in fp32 whatever their dtype: pass ``cos.float()``);
    * Wan's processor with ``rotary_emb = (freqs_cos, freqs_sin)``: pass
      ``freqs_cos[..., 0::2]`` and ``freqs_sin[..., 1::2]`` (the entries it reads), in
      whatever dtype they are (a bf16 Wan rotates in bf16, and so does the op).

``qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps=None, *, across_heads=False,
layout="interleaved", convention="torch")``
    ``rotary_embedding(rms_norm(q), ...)`` and the same for k, in one pass. The norm runs
    per head (``[D]`` weights: FLUX) or across heads (``across_heads=True``, ``[H * D]``
    weights: Wan, whose norm sees ``[B, L, H * D]`` before ``unflatten``). Outputs are
    ``[B, L, H, D]`` in the normalised dtype. Wan:
    ``qk_norm_rope(q.unflatten(2, (H, -1)), ..., norm_q.weight, norm_k.weight,
    freqs_cos[..., 0::2], freqs_sin[..., 1::2], norm_q.eps, across_heads=True)``; FLUX's
    single-stream block: ``qk_norm_rope(q.unflatten(-1, (-1, D)), ..., cos, sin, eps)``
    (its double-stream blocks norm text and image tokens with different weights before
    concatenating: one call per part, on its slice of the tables).

Precision (the README's contract; ``tests/precision.py`` holds the paths to it):

* ``exact``: bitwise equal to ``forward_native`` (the CPU path; GPUs run native).
* ``rms_norm`` fast: eager's roundings with another fp32 summation order: every
  bf16/fp16 element within 1 ulp of native (2 for diffusers with a bf16/fp16 weight,
  which rounds before and after it), at most 1e-3 of them off at all (measured 4e-6 to
  1e-4). fp32 outputs are exact on CPU, within rtol 1e-5 on Triton.
* ``rotary_embedding``: bitwise equal to eager on the CPU and Triton paths in both modes.
* ``qk_norm_rope`` fast: computed in fp32 and **rounded once**, where eager rounds the
  normalised value first (and, diffusers with a bf16/fp16 weight, once more before the
  weight), so about a third of the elements (40% with that weight) differ from native
  by a rounding. The bound is taken at the magnitude of each element's rotated pair,
  ``hypot(out1, out2)``: a rotation near an axis makes one member tiny, where eager's
  earlier rounding of the pair's inputs shows as many ulps of that member but never as
  more than an ulp of the pair. Every bf16/fp16 element is within 2 such ulps of
  native and at most 1e-3 of them beyond 1 (measured: torch convention never beyond 1;
  diffusers with a bf16/fp16 weight 1e-4 to 3.5e-4 beyond 1, none beyond 2), for
  tables of rotations (``cos^2 + sin^2 = 1``, as rope tables are). fp32 outputs are
  exact on CPU; on Triton within 1e-5 of the pair's magnitude. With bf16/fp16 tables
  that make eager rotate in bf16/fp16 (a Wan cast with ``.to(bf16)``) the CPU path runs
  eager's steps (exact) and Triton declines (native).

NaN and inf propagate as in the meaning: a NaN in a norm row makes the row NaN; an inf
makes its own element NaN (``inf * 0``) and the rest of the row 0; the rotation carries a
NaN to both members of its pair.

Paths: ``cpu`` (exact and fast, :mod:`ditops.kernels.cpu.qk_norm_rope`),
``cuda``/``hip``/``xpu`` through Triton (:mod:`ditops.kernels.triton.qk_norm_rope`, fast),
``npu`` through torch_npu's own kernels (fast; :mod:`ditops.kernels.npu.qk_norm_rope`
says what they are documented to do and cites the sources): ``rms_norm`` calls
``torch_npu.npu_rms_norm`` (computes in fp32, rounds once: the fast contract above),
``rotary_embedding`` ``torch_npu.npu_rotary_mul`` (``'half'`` or ``'interleave'``), called
in fp32 only: bf16/fp16 activations with fp32 tables are widened and the result rounded
once, as the meaning does (bf16/fp16 outputs within 1 ulp of the pair's magnitude, at
most 1e-3 of them off; fp32 within 1e-5 of it), and ``qk_norm_rope`` the two composed,
rounding the normalised value where eager does (within the fused op's fast contract).
Calls outside what torch_npu documents run the meaning with the reason in
``explain_call`` (:func:`npu_norm_reasons`, :func:`npu_rotary_reasons`): a rotation the
meaning computes in bf16/fp16 (bf16/fp16 tables), head dims of 896 or more, 1000 or more
batches or heads, per-batch tables in interleaved layout, tables outside ``[-1, 1]``,
empty inputs. Otherwise native.

The arguments' shapes and the call records: :mod:`ditops.ops.qk_norm_rope_args`. The
module users put in models: :class:`ditops.layers.rms_norm.RMSNorm`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ditops.backends.npu import torch_npu_op
from ditops.backends.triton import TRITON
from ditops.core.checks import FLOATS, check_choice, check_flag, check_tensor, dtype_name
from ditops.core.op import CustomOp, register_op
from ditops.core.paths import path
from ditops.kernels.npu import qk_norm_rope as npu_kernels
from ditops.ops import qk_norm_rope_args as args
from ditops.ops.qk_norm_rope_args import NormCall, QKCall, RopeCall
from ditops.tracing import traced

#: Widest norm row (elements) the Triton kernels hold in registers.
TRITON_MAX_ROW = 16384
#: torch_npu with the functions each NPU path calls (probed on first use).
NPU_RMS_NORM = torch_npu_op("npu_rms_norm")
NPU_ROTARY_MUL = torch_npu_op("npu_rotary_mul")
NPU_PROLOGUE = torch_npu_op("npu_rms_norm", "npu_rotary_mul")
#: ``npu_rotary_mul``: head dims below this (and even).
NPU_MAX_HEAD_DIM = 896
#: ``'half'``: batch and heads each below this; ``'interleave'``: their product.
NPU_MAX_BATCH_HEADS = 1000


# --- the meanings -------------------------------------------------------------------------


def native_rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float | None, convention: str
) -> torch.Tensor:
    if convention == "torch":
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    # diffusers.models.normalization.RMSNorm.forward (no bias, not the NPU branch)
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    y = x * torch.rsqrt(variance + eps)
    if weight is None:
        return y.to(x.dtype)
    if weight.dtype in (torch.float16, torch.bfloat16):
        y = y.to(weight.dtype)
    return y * weight


def _full_table(t3: torch.Tensor, D: int, layout: str) -> torch.Tensor:
    """[Bt, L, Dt] -> [Bt, L, 1, D]: one entry per element."""
    if t3.shape[-1] != D:
        t3 = t3.repeat_interleave(2, -1) if layout == "interleaved" else torch.cat([t3, t3], -1)
    return t3.unsqueeze(2)


def native_rotary(
    x: torch.Tensor, cos3: torch.Tensor, sin3: torch.Tensor, layout: str
) -> torch.Tensor:
    D = x.shape[-1]
    cos, sin = _full_table(cos3, D, layout), _full_table(sin3, D, layout)
    if layout == "interleaved":
        x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
        rotated = torch.stack([-x2, x1], dim=-1).flatten(-2)
    else:
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat([-x2, x1], dim=-1)
    ct = torch.promote_types(x.dtype, cos.dtype)
    return (x.to(ct) * cos + rotated.to(ct) * sin).to(x.dtype)


# --- the paths' reasons -----------------------------------------------------------------


def _triton_row_reasons(width: int) -> list[str]:
    if width > TRITON_MAX_ROW:
        return [f"norm rows of {width} elements: the Triton kernel holds <= {TRITON_MAX_ROW}"]
    return []


def _triton_compute_reasons(compute: torch.dtype) -> list[str]:
    if compute != torch.float32:
        return [
            f"the rotation is computed in {dtype_name(compute)} (tables in the "
            "activations' low-precision dtype); the Triton kernel computes in fp32"
        ]
    return []


def npu_norm_reasons(x: torch.Tensor) -> list[str]:
    """Why ``npu_rms_norm`` cannot take these activations."""
    if x.numel() == 0:
        return ["an empty input: torch_npu.npu_rms_norm takes no empty weight"]
    return []


def npu_rotary_reasons(
    x: torch.Tensor, cos3: torch.Tensor, sin3: torch.Tensor, layout: str, compute: torch.dtype
) -> list[str]:
    """Why ``npu_rotary_mul`` cannot rotate ``x`` [B, L, H, D] (normalised, for the fused
    op) with ``[Bt, L, Dt]`` tables as the meaning does (in ``compute``)."""
    B, _, H, D = x.shape
    reasons = []
    if compute != torch.float32:
        reasons.append(
            f"the rotation is computed in {dtype_name(compute)} (tables in the activations' "
            "low-precision dtype, rounding every product); torch_npu.npu_rotary_mul does not "
            "document its internal precision and is called in fp32 only"
        )
    if D >= NPU_MAX_HEAD_DIM:
        reasons.append(f"head dim {D}: torch_npu.npu_rotary_mul takes D < {NPU_MAX_HEAD_DIM}")
    if layout == "halves" and (B >= NPU_MAX_BATCH_HEADS or H >= NPU_MAX_BATCH_HEADS):
        reasons.append(
            f"batch {B}, heads {H}: torch_npu.npu_rotary_mul ('half') takes each "
            f"< {NPU_MAX_BATCH_HEADS}"
        )
    if layout == "interleaved" and B * H >= NPU_MAX_BATCH_HEADS:
        reasons.append(
            f"batch x heads = {B * H}: torch_npu.npu_rotary_mul ('interleave') takes "
            f"< {NPU_MAX_BATCH_HEADS}"
        )
    if layout == "interleaved" and cos3.shape[0] != 1:
        reasons.append(
            "per-batch tables: torch_npu.npu_rotary_mul ('interleave') takes [1, L, 1, D] "
            "tables only"
        )
    if x.numel() == 0:
        reasons.append("an empty input: torch_npu.npu_rotary_mul takes positive dims only")
    if not reasons and not traced() and not _unit_range(cos3, sin3):
        reasons.append(
            "cos/sin outside [-1, 1]: torch_npu.npu_rotary_mul documents tables within it"
        )
    return reasons


def _unit_range(cos3: torch.Tensor, sin3: torch.Tensor) -> bool:
    return bool(((cos3.abs() <= 1).all() & (sin3.abs() <= 1).all()).item())


def _triton_norm_reasons(c: NormCall) -> list[str]:
    return _triton_row_reasons(c.x.shape[-1])


def _npu_norm_call_reasons(c: NormCall) -> list[str]:
    return npu_norm_reasons(c.x)


def _triton_rope_reasons(c: RopeCall) -> list[str]:
    return _triton_compute_reasons(c.compute_dtype())


def _npu_rope_reasons(c: RopeCall) -> list[str]:
    return npu_rotary_reasons(c.x, c.cos3, c.sin3, c.layout, c.compute_dtype())


def _triton_qk_reasons(c: QKCall) -> list[str]:
    return [*_triton_row_reasons(c.norm_width()), *_triton_compute_reasons(c.compute_dtype())]


def _npu_qk_reasons(c: QKCall) -> list[str]:
    rotary = npu_rotary_reasons(c.q, c.cos3, c.sin3, c.layout, c.compute_dtype())
    return [*npu_norm_reasons(c.q), *rotary]


# --- the ops ----------------------------------------------------------------------------


@register_op("rms_norm")
class RMSNormOp(CustomOp):
    """RMSNorm over the last dim in torch's or diffusers' arithmetic; see the module docstring."""

    def prepare(  # type: ignore[override]
        self,
        x: torch.Tensor,
        weight: torch.Tensor | None = None,
        eps: float | None = None,
        convention: str = "torch",
    ) -> NormCall:
        op = "rms_norm"
        x = check_tensor(op, "x", x, args.ACTIVATIONS)
        if x.dim() == 0:
            raise ValueError(
                f"{op}: x must have at least one dim (the normalised one); got a scalar"
            )
        conv = str(check_choice(op, "convention", convention, args.CONVENTIONS))
        args.check_weight(weight, x.shape[-1], x, op, "weight", "N, the last dim of x")
        return NormCall(x, weight, eps, args.resolve_eps(eps, x.dtype, conv, op), conv)

    def not_supported(self, c: NormCall) -> list[str]:
        return args.torch_arithmetic_reasons(c.convention)

    def forward_native(self, c: NormCall) -> torch.Tensor:
        return native_rms_norm(c.x, c.weight, c.eps_arg, c.convention)

    @path(precisions=("exact", "fast"), dtypes=FLOATS, inference_only=True)
    def forward_cpu(self, c: NormCall) -> torch.Tensor:
        from ditops.kernels.cpu.qk_norm_rope import rms_norm as kernel

        return kernel(c.x, c.weight, c.eps, c.convention, c.exact)

    @path("cuda", "hip", "xpu", backend=TRITON, dtypes=FLOATS, inference_only=True,
          reasons=_triton_norm_reasons)  # fmt: skip
    def forward_cuda(self, c: NormCall) -> torch.Tensor:
        from ditops.kernels.triton.qk_norm_rope import rms_norm as kernel

        return kernel(c.x, c.weight, c.eps, c.convention)

    @path(backend=NPU_RMS_NORM, dtypes=FLOATS, inference_only=True,
          reasons=_npu_norm_call_reasons)  # fmt: skip
    def forward_npu(self, c: NormCall) -> torch.Tensor:
        fn = NPU_RMS_NORM.function("npu_rms_norm")
        return npu_kernels.rms_norm(fn, c.x, c.weight, c.eps, c.convention)


@register_op("rotary_embedding")
class RotaryEmbeddingOp(CustomOp):
    """``x * cos + rotate(x) * sin`` in diffusers' two layouts; see the module docstring."""

    def prepare(  # type: ignore[override]
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layout: str = "interleaved",
    ) -> RopeCall:
        op = "rotary_embedding"
        x = args.check_qk(x, op, "x")
        lay = str(check_choice(op, "layout", layout, args.LAYOUTS))
        cos3, sin3 = args.check_tables(cos, sin, x, op)
        return RopeCall(x, cos3, sin3, lay)

    def forward_native(self, c: RopeCall) -> torch.Tensor:
        return native_rotary(c.x, c.cos3, c.sin3, c.layout)

    @path(precisions=("exact", "fast"), dtypes=FLOATS, inference_only=True)
    def forward_cpu(self, c: RopeCall) -> torch.Tensor:
        from ditops.kernels.cpu.qk_norm_rope import rotary_embedding as kernel

        return kernel(c.x, c.cos3, c.sin3, c.layout)

    @path("cuda", "hip", "xpu", backend=TRITON, dtypes=FLOATS, inference_only=True,
          reasons=_triton_rope_reasons)  # fmt: skip
    def forward_cuda(self, c: RopeCall) -> torch.Tensor:
        from ditops.kernels.triton.qk_norm_rope import rotary_embedding as kernel

        return kernel(c.x, c.cos3, c.sin3, c.layout)

    @path(backend=NPU_ROTARY_MUL, dtypes=FLOATS, inference_only=True, reasons=_npu_rope_reasons)
    def forward_npu(self, c: RopeCall) -> torch.Tensor:
        D = c.x.shape[-1]
        cos = npu_kernels.full_tables(c.cos3, D, c.layout)
        sin = npu_kernels.full_tables(c.sin3, D, c.layout)
        fn = NPU_ROTARY_MUL.function("npu_rotary_mul")
        return npu_kernels.rotary(fn, c.x, cos, sin, c.layout)


@register_op("qk_norm_rope")
class QKNormRopeOp(CustomOp):
    """RMSNorm then rotary embedding of q and k in one pass; see the module docstring."""

    def prepare(  # type: ignore[override]
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        q_weight: torch.Tensor | None,
        k_weight: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        eps: float | None = None,
        *,
        across_heads: bool = False,
        layout: str = "interleaved",
        convention: str = "torch",
    ) -> QKCall:
        op = "qk_norm_rope"
        q = args.check_qk(q, op, "q")
        k = args.check_qk(k, op, "k")
        if k.shape != q.shape:
            raise ValueError(
                f"{op}: k has shape {list(k.shape)}; expected q's shape {list(q.shape)}"
            )
        if k.dtype != q.dtype:
            raise TypeError(f"{op}: k has dtype {k.dtype}; expected q's dtype {q.dtype}")
        if k.device != q.device:
            raise ValueError(f"{op}: k is on {k.device}; expected q's device {q.device}")
        across = check_flag(op, "across_heads", across_heads)
        lay = str(check_choice(op, "layout", layout, args.LAYOUTS))
        conv = str(check_choice(op, "convention", convention, args.CONVENTIONS))
        H, D = q.shape[2], q.shape[3]
        n, what = (H * D, "H * D (across heads)") if across else (D, "D (per head)")
        args.check_weight(q_weight, n, q, op, "q_weight", what)
        args.check_weight(k_weight, n, q, op, "k_weight", what)
        args.check_weight_pair(q_weight, k_weight, op)
        cos3, sin3 = args.check_tables(cos, sin, q, op)
        e = args.resolve_eps(eps, q.dtype, conv, op)
        return QKCall(q, k, q_weight, k_weight, cos3, sin3, eps, e, across, lay, conv)

    def not_supported(self, c: QKCall) -> list[str]:
        return args.torch_arithmetic_reasons(c.convention)

    def forward_native(self, c: QKCall) -> tuple[torch.Tensor, torch.Tensor]:
        def one(x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
            if c.across_heads:
                flat = native_rms_norm(x.flatten(2), w, c.eps_arg, c.convention)
                n = flat.unflatten(2, x.shape[2:])
            else:
                n = native_rms_norm(x, w, c.eps_arg, c.convention)
            return native_rotary(n, c.cos3, c.sin3, c.layout)

        return one(c.q, c.q_weight), one(c.k, c.k_weight)

    @path(precisions=("exact", "fast"), dtypes=FLOATS, inference_only=True)
    def forward_cpu(self, c: QKCall) -> tuple[torch.Tensor, torch.Tensor]:
        from ditops.kernels.cpu.qk_norm_rope import qk_norm_rope as kernel

        return kernel(
            c.q, c.k, c.q_weight, c.k_weight, c.cos3, c.sin3, c.eps,
            c.across_heads, c.layout, c.convention, c.exact,
        )  # fmt: skip

    @path("cuda", "hip", "xpu", backend=TRITON, dtypes=FLOATS, inference_only=True,
          reasons=_triton_qk_reasons)  # fmt: skip
    def forward_cuda(self, c: QKCall) -> tuple[torch.Tensor, torch.Tensor]:
        from ditops.kernels.triton.qk_norm_rope import qk_norm_rope as kernel

        return kernel(
            c.q, c.k, c.q_weight, c.k_weight, c.cos3, c.sin3, c.eps,
            c.across_heads, c.layout, c.convention,
        )  # fmt: skip

    @path(backend=NPU_PROLOGUE, dtypes=FLOATS, inference_only=True, reasons=_npu_qk_reasons)
    def forward_npu(self, c: QKCall) -> tuple[torch.Tensor, torch.Tensor]:
        norm = NPU_PROLOGUE.function("npu_rms_norm")
        rope = NPU_PROLOGUE.function("npu_rotary_mul")
        return npu_kernels.qk_norm_rope(
            norm, rope, c.q, c.k, c.q_weight, c.k_weight, c.cos3, c.sin3, c.eps,
            c.across_heads, c.layout, c.convention,
        )  # fmt: skip


#: ``rms_norm(x, weight=None, eps=None, convention="torch")``
rms_norm = RMSNormOp()
#: ``rotary_embedding(x, cos, sin, layout="interleaved")``
rotary_embedding = RotaryEmbeddingOp()
#: ``qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps=None, *, across_heads=False,
#: layout="interleaved", convention="torch") -> (q_out, k_out)``
qk_norm_rope = QKNormRopeOp()
