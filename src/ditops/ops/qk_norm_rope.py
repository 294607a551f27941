"""The attention prologue: RMSNorm of queries and keys, rotary embedding, and both fused.

In every DiT attention block q and k are normalised, then rotated, before attention.
Three ops, each with the literal eager code as its meaning (``forward_native``); each
public function's docstring states it with its shapes: :func:`rms_norm` (torch's or
diffusers' rounding, ``convention=``), :func:`rotary_embedding` (pairs interleaved or in
halves) and :func:`qk_norm_rope` (both for q and k, the norm per head or across heads).
The ``"torch"`` convention is torch 2.13's ``F.rms_norm`` arithmetic (one rounding, after
the weight); older releases rounded before the weight, so the fast paths check which one
the running torch has (:func:`torch_rms_norm_is_known`) and otherwise run the meaning.
FLUX's double-stream blocks norm text and image tokens with different weights before
concatenating: one call per part, on its slice of the tables.

Precision (docs/precision.md; ``tests/precision.py`` holds the paths to it):

* ``exact``: bitwise equal to ``forward_native`` (the CPU path; GPUs run native).
* ``rms_norm`` fast: measured 4e-6 to 1e-4 of the elements off; fp32 outputs are exact
  on CPU, within rtol 1e-5 on Triton.
* ``qk_norm_rope`` fast: about a third of the elements (40% with a diffusers bf16/fp16
  weight) differ from native by a rounding. The bound is taken at the magnitude of each
  element's rotated pair, ``hypot(out1, out2)``: a rotation near an axis makes one member
  tiny, where eager's earlier rounding of the pair's inputs shows as many ulps of that
  member but never as more than an ulp of the pair (measured: torch convention never
  beyond 1; diffusers with a bf16/fp16 weight 1e-4 to 3.5e-4 beyond 1, none beyond 2),
  for tables of rotations (``cos^2 + sin^2 = 1``). fp32 outputs are exact on CPU; on
  Triton within 1e-5 of the pair's magnitude. With bf16/fp16 tables
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
``explain_call`` (:mod:`ditops.kernels.npu.qk_norm_rope`): a rotation the
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
from ditops.core.public import public_op
from ditops.kernels.npu import qk_norm_rope as npu_kernels
from ditops.ops import qk_norm_rope_args as args
from ditops.ops.qk_norm_rope_args import NormCall, QKCall, RopeCall

#: Widest norm row (elements) the Triton kernels hold in registers.
TRITON_MAX_ROW = 16384
#: torch_npu with the functions each NPU path calls (probed on first use).
NPU_RMS_NORM = torch_npu_op("npu_rms_norm")
NPU_ROTARY_MUL = torch_npu_op("npu_rotary_mul")
NPU_PROLOGUE = torch_npu_op("npu_rms_norm", "npu_rotary_mul")


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


def _triton_norm_reasons(c: NormCall) -> list[str]:
    return _triton_row_reasons(c.x.shape[-1])


def _npu_norm_call_reasons(c: NormCall) -> list[str]:
    return npu_kernels.npu_norm_reasons(c.x)


def _triton_rope_reasons(c: RopeCall) -> list[str]:
    return _triton_compute_reasons(c.compute_dtype())


def _npu_rope_reasons(c: RopeCall) -> list[str]:
    return npu_kernels.npu_rotary_reasons(c.x, c.cos3, c.sin3, c.layout, c.compute_dtype())


def _triton_qk_reasons(c: QKCall) -> list[str]:
    return [*_triton_row_reasons(c.norm_width()), *_triton_compute_reasons(c.compute_dtype())]


def _npu_qk_reasons(c: QKCall) -> list[str]:
    rotary = npu_kernels.npu_rotary_reasons(c.q, c.cos3, c.sin3, c.layout, c.compute_dtype())
    return [*npu_kernels.npu_norm_reasons(c.q), *rotary]


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

    @path(precisions=("exact", "fast"), dtypes=FLOATS, inference_only=True, fast_bits="native")
    def forward_cpu(self, c: RopeCall) -> torch.Tensor:  # eager's bits in both precisions
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


@public_op(RMSNormOp())
def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float | None = None,
    convention: str = "torch",
) -> torch.Tensor:
    """RMSNorm over the last dim, in torch's or diffusers' arithmetic.

    Meaning (``r = rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)``, in fp32):

    - ``convention="torch"`` (``torch.nn.RMSNorm``, Wan's and FLUX's q/k norms):
      ``(x.float() * r * weight.float()).to(x.dtype)``, rounded once.
    - ``convention="diffusers"`` (diffusers' ``RMSNorm`` without bias: HunyuanVideo):
      ``x.float() * r``; no weight: rounded to x's dtype; a bf16/fp16 weight: rounded to
      the weight's dtype, then times the weight; an fp32 weight: times it, kept in fp32.

    Shapes and dtypes:
        x: ``[..., N]``, at least 1-D, fp32/bf16/fp16 (fp64 runs the meaning).
        weight: ``[N]`` or None, any float dtype.
        eps: a positive float; None: fp32's machine epsilon (torch) or 1e-6 (diffusers).
        convention: ``"torch"`` or ``"diffusers"``.

    Returns x's shape, in x's dtype (diffusers with a weight: the weight's dtype, as there).

    Precision: ``exact`` is bitwise the meaning (CPU); ``fast`` keeps eager's roundings
    with another fp32 summation order: within 1 ulp (2 for diffusers with a bf16/fp16
    weight) on at most 1e-3 of the elements. NaN and inf propagate as in the meaning.
    """


@public_op(RotaryEmbeddingOp())
def rotary_embedding(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str = "interleaved"
) -> torch.Tensor:
    """The rotary position embedding: ``x * cos + rotate(x) * sin``.

    Meaning: every product and the sum in ``promote_types(x.dtype, cos.dtype)``, rounded
    once to x's dtype; ``rotate`` maps a pair ``(x1, x2)`` to ``(-x2, x1)``. This is bit for
    bit diffusers' ``apply_rotary_emb(..., sequence_dim=1)`` with fp32 tables, and Wan's
    processor given ``freqs_cos[..., 0::2]`` and ``freqs_sin[..., 1::2]``.

    Shapes and dtypes:
        x: ``[B, L, H, D]``, fp32/bf16/fp16, D even.
        cos, sin: ``[L, Dt]`` or ``[Bt, L, 1, Dt]`` with ``Dt = D`` (an entry per element)
            or ``D / 2`` (one angle per pair), fp32 or x's dtype.
        layout: how pairs are formed: ``"interleaved"`` ``(x[2i], x[2i+1])`` (Wan, FLUX:
            ``use_real_unbind_dim=-1``) or ``"halves"`` ``(x[i], x[i + D/2])`` (``-2``).

    Returns x's shape and dtype.

    Precision: the CPU and Triton paths are bitwise the meaning; the NPU path is ``fast``
    (within 1 ulp of each rotated pair's magnitude). NaN carries to both members of a pair.
    """


@public_op(QKNormRopeOp())
def qk_norm_rope(
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention prologue: RMSNorm of q and k, then the rotary embedding, in one pass.

    Meaning::

        rotary_embedding(rms_norm(q, q_weight, eps, convention), cos, sin, layout)
        # and the same for k, with k_weight

    The norm runs per head (``[D]`` weights: FLUX) or across heads (``across_heads=True``,
    ``[H * D]`` weights: Wan, whose norm sees ``[B, L, H * D]``). Wan::

        qk_norm_rope(q.unflatten(2, (H, -1)), k.unflatten(2, (H, -1)), norm_q.weight,
                     norm_k.weight, freqs_cos[..., 0::2], freqs_sin[..., 1::2],
                     norm_q.eps, across_heads=True)

    Shapes and dtypes:
        q, k: ``[B, L, H, D]`` (k may have its own L and H), fp32/bf16/fp16.
        q_weight, k_weight: ``[D]`` or, with ``across_heads``, ``[H * D]``; or None.
        cos, sin: ``[L, Dt]`` or ``[Bt, L, 1, Dt]``, ``Dt = D`` or ``D / 2``, fp32 or q's
            dtype (see :func:`rotary_embedding`).
        eps: the norm's epsilon (None: as :func:`rms_norm`).
        across_heads: normalise over all heads of a token (Wan) instead of per head.
        layout: ``"interleaved"`` or ``"halves"`` (see :func:`rotary_embedding`).
        convention: ``"torch"`` or ``"diffusers"`` (see :func:`rms_norm`).

    Returns ``(q_out, k_out)``, ``[B, L, H, D]`` in the normalised dtype.

    Precision: ``exact`` is bitwise the meaning (CPU; GPUs run the meaning); ``fast``
    computes in fp32 and rounds once where eager rounds the normalised value first: every
    bf16/fp16 element within 2 ulps of its rotated pair's magnitude, at most 1e-3 of them
    beyond 1. NaN and inf propagate as in the meaning.
    """
