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
``explain_call``: a rotation the meaning computes in bf16/fp16 (bf16/fp16 tables), head
dims of 896 or more, 1000 or more batches or heads, per-batch tables in interleaved
layout, tables outside ``[-1, 1]``, empty inputs. Otherwise native.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ditops.backends.npu import torch_npu_op
from ditops.backends.triton import TRITON
from ditops.custom_op import CustomOp, fast_path, register_op
from ditops.kernels import qk_norm_rope_shapes as shapes
from ditops.kernels.npu import qk_norm_rope as npu_kernels

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
#: Widest norm row (elements) the Triton kernels hold in registers.
TRITON_MAX_ROW = 16384
#: torch_npu with the functions each NPU path calls (probed on first use).
NPU_RMS_NORM = torch_npu_op("npu_rms_norm")
NPU_ROTARY_MUL = torch_npu_op("npu_rotary_mul")
NPU_PROLOGUE = torch_npu_op("npu_rms_norm", "npu_rotary_mul")


def torch_rms_norm_is_known() -> bool:
    """Whether this torch's ``F.rms_norm`` computes what the kernels reproduce (torch
    2.13's arithmetic: the weight applied in fp32, one rounding to x's dtype).

    Probed once, when this module is imported (a few rows: well under a millisecond), so
    that ``torch.compile`` reads a constant instead of tracing the probe.
    """
    return _TORCH_RMS_NORM_KNOWN


def _probe_torch_rms_norm() -> bool:
    """bf16 rows with a bf16 and with an fp32 weight (the latter takes torch's composite
    path, which warns once about the dtype mismatch: silenced)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(6, 48, generator=g) * 3).to(torch.bfloat16)
    x32 = x.float()
    r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)
    w = torch.randn(48, generator=g) * 0.7 + 1
    for wt in (w.to(torch.bfloat16), w):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = F.rms_norm(x, (48,), wt, 1e-6)
        want = (x32 * r * wt.float()).to(torch.bfloat16)
        if got.dtype != torch.bfloat16 or not torch.equal(got, want):
            return False
    return True


_TORCH_RMS_NORM_KNOWN = _probe_torch_rms_norm()

_UNKNOWN_TORCH = (
    f"torch {torch.__version__}'s F.rms_norm rounds differently from torch 2.13's "
    "arithmetic the kernels reproduce; running the meaning"
)


# --- validated calls --------------------------------------------------------------------


class _NormCall(NamedTuple):
    x: torch.Tensor
    weight: torch.Tensor | None
    eps_arg: float | None  # as given (the meaning takes it)
    eps: float  # resolved (the kernels take it)
    convention: str


class _RopeCall(NamedTuple):
    x: torch.Tensor
    cos: torch.Tensor  # as given
    sin: torch.Tensor
    cos3: torch.Tensor  # [Bt, L, Dt] views
    sin3: torch.Tensor
    layout: str


class _QKCall(NamedTuple):
    q: torch.Tensor
    k: torch.Tensor
    q_weight: torch.Tensor | None
    k_weight: torch.Tensor | None
    cos: torch.Tensor
    sin: torch.Tensor
    cos3: torch.Tensor
    sin3: torch.Tensor
    eps_arg: float | None
    eps: float
    across_heads: bool
    layout: str
    convention: str


def _prepare_norm(
    x: Any, weight: Any = None, eps: Any = None, convention: Any = "torch"
) -> _NormCall:
    op = "rms_norm"
    x = shapes.check_tensor(x, op, "x")
    if x.dim() == 0:
        raise ValueError(f"{op}: x must have at least one dim (the normalised one); got a scalar")
    conv = shapes.check_choice(convention, shapes.CONVENTIONS, op, "convention")
    shapes.check_weight(weight, x.shape[-1], x, op, "weight", "N, the last dim of x")
    return _NormCall(x, weight, eps, shapes.resolve_eps(eps, x.dtype, conv, op), conv)


def _prepare_rope(x: Any, cos: Any, sin: Any, layout: Any = "interleaved") -> _RopeCall:
    op = "rotary_embedding"
    x = shapes.check_qk(x, op, "x")
    lay = shapes.check_choice(layout, shapes.LAYOUTS, op, "layout")
    cos3, sin3 = shapes.check_tables(cos, sin, x, op)
    return _RopeCall(x, cos, sin, cos3, sin3, lay)


def _prepare_qk(
    q: Any,
    k: Any,
    q_weight: Any,
    k_weight: Any,
    cos: Any,
    sin: Any,
    eps: Any = None,
    across_heads: Any = False,
    layout: Any = "interleaved",
    convention: Any = "torch",
) -> _QKCall:
    op = "qk_norm_rope"
    q = shapes.check_qk(q, op, "q")
    k = shapes.check_qk(k, op, "k")
    if k.shape != q.shape:
        raise ValueError(f"{op}: k has shape {list(k.shape)}; expected q's shape {list(q.shape)}")
    if k.dtype != q.dtype:
        raise TypeError(f"{op}: k has dtype {k.dtype}; expected q's dtype {q.dtype}")
    if k.device != q.device:
        raise ValueError(f"{op}: k is on {k.device}; expected q's device {q.device}")
    if not isinstance(across_heads, bool):
        raise TypeError(f"{op}: across_heads must be a bool, got {type(across_heads).__name__}")
    lay = shapes.check_choice(layout, shapes.LAYOUTS, op, "layout")
    conv = shapes.check_choice(convention, shapes.CONVENTIONS, op, "convention")
    H, D = q.shape[2], q.shape[3]
    n, what = (H * D, "H * D (across heads)") if across_heads else (D, "D (per head)")
    shapes.check_weight(q_weight, n, q, op, "q_weight", what)
    shapes.check_weight(k_weight, n, q, op, "k_weight", what)
    if (q_weight is None) != (k_weight is None) or (
        q_weight is not None and q_weight.dtype != k_weight.dtype
    ):
        raise TypeError(
            f"{op}: q_weight and k_weight must both be None or both tensors of one dtype; got "
            f"{_describe(q_weight)} and {_describe(k_weight)}"
        )
    cos3, sin3 = shapes.check_tables(cos, sin, q, op)
    e = shapes.resolve_eps(eps, q.dtype, conv, op)
    return _QKCall(q, k, q_weight, k_weight, cos, sin, cos3, sin3, eps, e, across_heads, lay, conv)


def _describe(w: torch.Tensor | None) -> str:
    return "None" if w is None else f"a {str(w.dtype).replace('torch.', '')} tensor"


# --- the meanings -------------------------------------------------------------------------


def _native_rms_norm(
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


def _native_rotary(
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


def _native_qk(c: _QKCall) -> tuple[torch.Tensor, torch.Tensor]:
    def one(x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
        if c.across_heads:
            n = _native_rms_norm(x.flatten(2), w, c.eps_arg, c.convention).unflatten(2, x.shape[2:])
        else:
            n = _native_rms_norm(x, w, c.eps_arg, c.convention)
        return _native_rotary(n, c.cos3, c.sin3, c.layout)

    return one(c.q, c.q_weight), one(c.k, c.k_weight)


# --- the ops ----------------------------------------------------------------------------


class _PrologueOp(CustomOp):
    """Shared plumbing: one validation per call, handed to the path as ``call``."""

    def _validate(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def _call(self, *args: Any, call: Any = None, **kwargs: Any) -> Any:
        """The validated call: ``forward`` hands it to the path it dispatches to; a direct
        call of a path (or ``explain_call``) validates its arguments itself."""
        return call if call is not None else self._validate(*args, **kwargs)

    def _exact(self) -> bool:
        return self.resolved_precision() == "exact"


def _triton_reasons(
    convention: str | None, width: int, compute: torch.dtype | None = None
) -> list[str]:
    reasons = []
    if convention == "torch" and not torch_rms_norm_is_known():
        reasons.append(_UNKNOWN_TORCH)
    if width > TRITON_MAX_ROW:
        reasons.append(
            f"norm rows of {width} elements: the Triton kernel holds <= {TRITON_MAX_ROW}"
        )
    if compute is not None and compute != torch.float32:
        reasons.append(
            f"the rotation is computed in {str(compute).replace('torch.', '')} (tables in the "
            "activations' low-precision dtype); the Triton kernel computes in fp32"
        )
    return reasons


def _npu_norm_reasons(convention: str, x: torch.Tensor) -> list[str]:
    unknown = convention == "torch" and not torch_rms_norm_is_known()
    return [*([_UNKNOWN_TORCH] if unknown else []), *npu_kernels.norm_reasons(x)]


@register_op("rms_norm")
class RMSNormOp(_PrologueOp):
    """RMSNorm over the last dim in torch's or diffusers' arithmetic; see the module docstring."""

    def forward(  # type: ignore[override]
        self,
        x: torch.Tensor,
        weight: torch.Tensor | None = None,
        eps: float | None = None,
        convention: str = "torch",
    ) -> torch.Tensor:
        call = self._validate(x, weight, eps, convention)
        return self.dispatch(x, weight, eps, convention, call=call)

    def _validate(self, *args: Any, **kwargs: Any) -> _NormCall:
        return _prepare_norm(*args, **kwargs)

    def fast_path_reasons(self, kind: str, *args: Any, **kwargs: Any) -> list[str]:
        c: _NormCall = self._call(*args, **kwargs)
        if kind == "cpu":
            unknown = c.convention == "torch" and not torch_rms_norm_is_known()
            return [_UNKNOWN_TORCH] if unknown else []
        if kind in ("cuda", "hip", "xpu"):
            return _triton_reasons(c.convention, c.x.shape[-1])
        if kind == "npu":
            return _npu_norm_reasons(c.convention, c.x)
        return []

    def forward_native(self, *args: Any, call: _NormCall | None = None) -> torch.Tensor:
        c = self._call(*args, call=call)
        return _native_rms_norm(c.x, c.weight, c.eps_arg, c.convention)

    @fast_path(precisions=("exact", "fast"), dtypes=_FLOATS, inference_only=True)
    def forward_cpu(self, *args: Any, call: _NormCall | None = None) -> torch.Tensor:
        from ditops.kernels.cpu.qk_norm_rope import rms_norm as kernel

        c = self._call(*args, call=call)
        return kernel(c.x, c.weight, c.eps, c.convention, self._exact())

    @fast_path(backend=TRITON, precisions=("fast",), dtypes=_FLOATS, inference_only=True)
    def forward_cuda(self, *args: Any, call: _NormCall | None = None) -> torch.Tensor:
        from ditops.kernels.triton.qk_norm_rope import rms_norm as kernel

        c = self._call(*args, call=call)
        return kernel(c.x, c.weight, c.eps, c.convention)

    forward_hip = forward_cuda
    forward_xpu = forward_cuda

    @fast_path(backend=NPU_RMS_NORM, precisions=("fast",), dtypes=_FLOATS, inference_only=True)
    def forward_npu(self, *args: Any, call: _NormCall | None = None) -> torch.Tensor:
        c = self._call(*args, call=call)
        fn = NPU_RMS_NORM.function("npu_rms_norm")
        return npu_kernels.rms_norm(fn, c.x, c.weight, c.eps, c.convention)


@register_op("rotary_embedding")
class RotaryEmbeddingOp(_PrologueOp):
    """``x * cos + rotate(x) * sin`` in diffusers' two layouts; see the module docstring."""

    def forward(  # type: ignore[override]
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layout: str = "interleaved",
    ) -> torch.Tensor:
        call = self._validate(x, cos, sin, layout)
        return self.dispatch(x, cos, sin, layout, call=call)

    def _validate(self, *args: Any, **kwargs: Any) -> _RopeCall:
        return _prepare_rope(*args, **kwargs)

    def fast_path_reasons(self, kind: str, *args: Any, **kwargs: Any) -> list[str]:
        c: _RopeCall = self._call(*args, **kwargs)
        compute = torch.promote_types(c.x.dtype, c.cos3.dtype)
        if kind in ("cuda", "hip", "xpu"):
            return _triton_reasons(None, 0, compute)
        if kind == "npu":
            return npu_kernels.rotary_reasons(c.x, c.cos3, c.sin3, c.layout, compute)
        return []

    def forward_native(self, *args: Any, call: _RopeCall | None = None) -> torch.Tensor:
        c = self._call(*args, call=call)
        return _native_rotary(c.x, c.cos3, c.sin3, c.layout)

    @fast_path(precisions=("exact", "fast"), dtypes=_FLOATS, inference_only=True)
    def forward_cpu(self, *args: Any, call: _RopeCall | None = None) -> torch.Tensor:
        from ditops.kernels.cpu.qk_norm_rope import rotary_embedding as kernel

        c = self._call(*args, call=call)
        return kernel(c.x, c.cos3, c.sin3, c.layout)

    @fast_path(backend=TRITON, precisions=("fast",), dtypes=_FLOATS, inference_only=True)
    def forward_cuda(self, *args: Any, call: _RopeCall | None = None) -> torch.Tensor:
        from ditops.kernels.triton.qk_norm_rope import rotary_embedding as kernel

        c = self._call(*args, call=call)
        return kernel(c.x, c.cos3, c.sin3, c.layout)

    forward_hip = forward_cuda
    forward_xpu = forward_cuda

    @fast_path(backend=NPU_ROTARY_MUL, precisions=("fast",), dtypes=_FLOATS, inference_only=True)
    def forward_npu(self, *args: Any, call: _RopeCall | None = None) -> torch.Tensor:
        c = self._call(*args, call=call)
        D = c.x.shape[-1]
        cos = npu_kernels.full_tables(c.cos3, D, c.layout)
        sin = npu_kernels.full_tables(c.sin3, D, c.layout)
        fn = NPU_ROTARY_MUL.function("npu_rotary_mul")
        return npu_kernels.rotary(fn, c.x, cos, sin, c.layout)


@register_op("qk_norm_rope")
class QKNormRopeOp(_PrologueOp):
    """RMSNorm then rotary embedding of q and k in one pass; see the module docstring."""

    def forward(  # type: ignore[override]
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
    ) -> tuple[torch.Tensor, torch.Tensor]:
        args = (q, k, q_weight, k_weight, cos, sin, eps, across_heads, layout, convention)
        call = self._validate(*args)
        return self.dispatch(*args, call=call)

    def _validate(self, *args: Any, **kwargs: Any) -> _QKCall:
        return _prepare_qk(*args, **kwargs)

    def fast_path_reasons(self, kind: str, *args: Any, **kwargs: Any) -> list[str]:
        c: _QKCall = self._call(*args, **kwargs)
        unknown = c.convention == "torch" and not torch_rms_norm_is_known()
        if kind == "cpu":
            return [_UNKNOWN_TORCH] if unknown else []
        H, D = c.q.shape[2], c.q.shape[3]
        wd = None if c.q_weight is None else c.q_weight.dtype
        normed = shapes.normed_dtype(c.q.dtype, wd, c.convention)
        compute = torch.promote_types(normed, c.cos3.dtype)
        if kind in ("cuda", "hip", "xpu"):
            return _triton_reasons(c.convention, H * D if c.across_heads else D, compute)
        if kind == "npu":
            return [
                *_npu_norm_reasons(c.convention, c.q),
                *npu_kernels.rotary_reasons(c.q, c.cos3, c.sin3, c.layout, compute),
            ]
        return []

    def forward_native(
        self, *args: Any, call: _QKCall | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return _native_qk(self._call(*args, call=call))

    @fast_path(precisions=("exact", "fast"), dtypes=_FLOATS, inference_only=True)
    def forward_cpu(
        self, *args: Any, call: _QKCall | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from ditops.kernels.cpu.qk_norm_rope import qk_norm_rope as kernel

        c = self._call(*args, call=call)
        return kernel(
            c.q, c.k, c.q_weight, c.k_weight, c.cos3, c.sin3, c.eps,
            c.across_heads, c.layout, c.convention, self._exact(),
        )  # fmt: skip

    @fast_path(backend=TRITON, precisions=("fast",), dtypes=_FLOATS, inference_only=True)
    def forward_cuda(
        self, *args: Any, call: _QKCall | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from ditops.kernels.triton.qk_norm_rope import qk_norm_rope as kernel

        c = self._call(*args, call=call)
        return kernel(
            c.q, c.k, c.q_weight, c.k_weight, c.cos3, c.sin3, c.eps,
            c.across_heads, c.layout, c.convention,
        )  # fmt: skip

    forward_hip = forward_cuda
    forward_xpu = forward_cuda

    @fast_path(backend=NPU_PROLOGUE, precisions=("fast",), dtypes=_FLOATS, inference_only=True)
    def forward_npu(
        self, *args: Any, call: _QKCall | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        c = self._call(*args, call=call)
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


# --- a module that stands in for an RMSNorm ------------------------------------------------


class RMSNorm(nn.Module):
    """An RMSNorm over the last dim, in ``torch.nn.RMSNorm``'s or diffusers' arithmetic.

    Same state-dict key as both (``weight``). ``from_module`` converts a
    ``torch.nn.RMSNorm`` (convention ``"torch"``) or a diffusers ``RMSNorm`` without bias
    (``"diffusers"``), sharing its parameter. ``precision`` (``"exact"``/``"fast"``/None)
    overrides the process setting for this module.
    """

    def __init__(
        self,
        dim: int,
        eps: float | None = None,
        elementwise_affine: bool = True,
        convention: str = "torch",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        precision: str | None = None,
    ) -> None:
        super().__init__()
        if precision not in (None, "exact", "fast"):
            raise ValueError(f"precision must be None, 'exact' or 'fast', got {precision!r}")
        self.dim = int(dim)
        self.eps = eps
        self.convention = shapes.check_choice(
            convention, shapes.CONVENTIONS, "RMSNorm", "convention"
        )
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(self.dim, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.op = RMSNormOp()
        self.op.precision = precision

    @classmethod
    def from_module(cls, module: nn.Module, precision: str | None = None) -> RMSNorm:
        """An RMSNorm sharing ``module``'s weight and eps (torch's or diffusers' RMSNorm)."""
        if isinstance(module, nn.RMSNorm):
            shape = tuple(module.normalized_shape)
            convention = "torch"
        elif type(module).__name__ == "RMSNorm" and type(module).__module__.startswith(
            "diffusers."
        ):
            shape = tuple(module.dim)
            convention = "diffusers"
            if getattr(module, "bias", None) is not None:
                raise ValueError(
                    "RMSNorm.from_module: diffusers RMSNorm with a bias is not supported; "
                    "expected bias=None"
                )
        else:
            raise TypeError(
                "RMSNorm.from_module expects a torch.nn.RMSNorm or a diffusers RMSNorm, got "
                f"{type(module).__module__}.{type(module).__name__}"
            )
        if len(shape) != 1:
            raise ValueError(
                f"RMSNorm.from_module: normalises the last dim only; expected one dim, got {shape}"
            )
        new = cls(shape[0], module.eps, elementwise_affine=False, convention=convention,
                  precision=precision)  # fmt: skip
        new.elementwise_affine = module.weight is not None
        new.weight = module.weight
        new.train(module.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x, self.weight, self.eps, self.convention)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, convention={self.convention!r}"
