"""The arguments of the q/k prologue ops (:mod:`ditops.ops.qk_norm_rope`): their call
records and the checks their ``prepare`` methods are made of.

Shapes
    Queries and keys ``q``, ``k`` (and the rotary op's ``x``): ``[B, L, H, D]`` (batch,
    tokens, heads, head dim), the layout diffusers' attention processors hold them in
    after ``unflatten``; any strides. ``D`` is even: the rotation turns pairs.
    ``cos``/``sin`` (same shape, same dtype): ``[L, Dt]`` (FLUX's ``FluxPosEmbed``) or
    ``[Bt, L, 1, Dt]`` (Wan's ``WanRotaryPosEmbed``), ``Bt`` in ``{1, B}``, where

    * ``Dt = D``: one entry per element, read as diffusers' ``apply_rotary_emb`` reads
      its tables (element ``j`` uses ``cos[j]`` and ``sin[j]``);
    * ``Dt = D / 2``: one angle per rotated pair (both members use it).

    Their dtype is fp32 (as the models keep them) or the activations' dtype (a Wan model
    cast with ``.to(bf16)`` casts its rope buffers too). The records hold them as
    ``[Bt, L, Dt]`` views (no copy).

Layouts (which elements form a pair)
    ``"interleaved"``: ``(x[2i], x[2i + 1])`` (Wan's processor; FLUX, CogVideoX and
    HunyuanDiT through ``apply_rotary_emb(..., use_real_unbind_dim=-1)``);
    ``"halves"``: ``(x[i], x[i + D/2])`` (``use_real_unbind_dim=-2``: Stable Audio,
    CogView4, Cosmos).

Also here: whether the running torch's ``F.rms_norm`` has the arithmetic the kernels
reproduce (:func:`torch_rms_norm_is_known`), a refusal every path of the norm ops shares.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ditops.core.calls import OpCall
from ditops.core.checks import FLOATS, check_eps, check_tensor, dtype_name
from ditops.kernels.qk_norm_rope_tables import normed_dtype

LAYOUTS = ("interleaved", "halves")
CONVENTIONS = ("torch", "diffusers")
#: The activations' dtypes the meanings take (fp64 runs the meaning: no path takes it).
ACTIVATIONS = (*FLOATS, torch.float64)


# --- call records -----------------------------------------------------------------------


@dataclass(slots=True)
class NormCall(OpCall):
    x: torch.Tensor
    weight: torch.Tensor | None
    eps_arg: float | None  # as given (the meaning takes it)
    eps: float  # resolved (the kernels take it)
    convention: str


@dataclass(slots=True)
class RopeCall(OpCall):
    x: torch.Tensor
    cos3: torch.Tensor  # [Bt, L, Dt] views of the tables
    sin3: torch.Tensor
    layout: str

    def compute_dtype(self) -> torch.dtype:
        """The dtype the meaning rotates in."""
        return torch.promote_types(self.x.dtype, self.cos3.dtype)


@dataclass(slots=True)
class QKCall(OpCall):
    q: torch.Tensor
    k: torch.Tensor
    q_weight: torch.Tensor | None
    k_weight: torch.Tensor | None
    cos3: torch.Tensor
    sin3: torch.Tensor
    eps_arg: float | None
    eps: float
    across_heads: bool
    layout: str
    convention: str

    def norm_width(self) -> int:
        """Elements per norm row: one head, or every head of a token."""
        H, D = self.q.shape[2], self.q.shape[3]
        return H * D if self.across_heads else D

    def compute_dtype(self) -> torch.dtype:
        """The dtype the meaning rotates the normalised q and k in."""
        wd = None if self.q_weight is None else self.q_weight.dtype
        return torch.promote_types(normed_dtype(self.q.dtype, wd, self.convention), self.cos3.dtype)


# --- checks -----------------------------------------------------------------------------


def resolve_eps(eps: object, x_dtype: torch.dtype, convention: str, op: str) -> float:
    """The epsilon the arithmetic adds. ``None`` is torch's default (``torch.nn.RMSNorm``):
    the machine epsilon of the computation dtype (fp32 for fp32/bf16/fp16 inputs);
    diffusers' ``RMSNorm`` has no default."""
    if eps is None:
        if convention == "diffusers":
            raise TypeError(
                f"{op}: the 'diffusers' convention needs an eps (diffusers' RMSNorm has no default)"
            )
        compute = torch.float64 if x_dtype == torch.float64 else torch.float32
        return float(torch.finfo(compute).eps)
    return check_eps(op, eps)


def check_weight(w: object, n: int, x: torch.Tensor, op: str, name: str, what: str) -> None:
    """A norm weight: None or an fp32/bf16/fp16 (or x's dtype) ``[n]`` tensor on x's device."""
    if w is None:
        return
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a tensor or None, got {type(w).__name__}")
    if w.dtype not in (*FLOATS, x.dtype):
        raise TypeError(
            f"{op}: {name} has dtype {dtype_name(w.dtype)}; expected float32, bfloat16 or float16"
        )
    if tuple(w.shape) != (n,):
        raise ValueError(f"{op}: {name} must have shape [{what}] = [{n}], got {list(w.shape)}")
    if w.device != x.device:
        raise ValueError(f"{op}: {name} is on {w.device} but the activations are on {x.device}")


def check_qk(x: object, op: str, name: str) -> torch.Tensor:
    """A ``[B, L, H, D]`` float tensor with an even ``D``."""
    t = check_tensor(op, name, x, ACTIVATIONS)
    if t.dim() != 4:
        raise ValueError(
            f"{op}: {name} must be [B, L, H, D] (batch, tokens, heads, head dim), got shape "
            f"{list(t.shape)}"
        )
    if t.shape[-1] % 2:
        raise ValueError(
            f"{op}: {name} has an odd head dim D = {t.shape[-1]}; the rotation turns pairs of "
            "elements, so D must be even"
        )
    return t


def check_tables(
    cos: object, sin: object, x: torch.Tensor, op: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate cos/sin against ``x`` [B, L, H, D]; return them as ``[Bt, L, Dt]`` views."""
    B, L, _, D = x.shape
    c = check_tensor(op, "cos", cos, ACTIVATIONS)
    s = check_tensor(op, "sin", sin, ACTIVATIONS)
    if c.shape != s.shape:
        raise ValueError(
            f"{op}: cos has shape {list(c.shape)} but sin has {list(s.shape)}; expected the same"
        )
    if c.dtype != s.dtype:
        raise TypeError(
            f"{op}: cos has dtype {dtype_name(c.dtype)} but sin has {dtype_name(s.dtype)}; "
            "expected the same"
        )
    if c.dtype not in (torch.float32, x.dtype):
        raise TypeError(
            f"{op}: cos/sin have dtype {dtype_name(c.dtype)}; expected float32 (as the models "
            f"keep them) or the activations' dtype {dtype_name(x.dtype)}"
        )
    if c.device != x.device or s.device != x.device:
        raise ValueError(f"{op}: cos/sin are on {c.device} but the activations are on {x.device}")
    shape = list(c.shape)
    expected = f"[L, Dt] or [Bt, L, 1, Dt] with L = {L}, Bt in {{1, {B}}}, Dt in {{{D}, {D // 2}}}"
    bad = ValueError(
        f"{op}: cos/sin of shape {shape} do not fit activations [B, L, H, D] = "
        f"{list(x.shape)}; expected {expected}"
    )
    if c.dim() == 2:
        c3, s3 = c.unsqueeze(0), s.unsqueeze(0)
    elif c.dim() == 4 and shape[2] == 1 and shape[0] in (1, B):
        c3, s3 = c.squeeze(2), s.squeeze(2)
    else:
        raise bad
    if c3.shape[1] != L or c3.shape[2] not in (D, D // 2):
        raise bad
    return c3, s3


def check_weight_pair(
    q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, op: str
) -> None:
    """q's and k's weights (each checked by :func:`check_weight`): both None or both
    tensors of one dtype."""
    if (q_weight is None) != (k_weight is None) or (
        q_weight is not None and k_weight is not None and q_weight.dtype != k_weight.dtype
    ):
        raise TypeError(
            f"{op}: q_weight and k_weight must both be None or both tensors of one dtype; got "
            f"{_describe(q_weight)} and {_describe(k_weight)}"
        )


def _describe(w: torch.Tensor | None) -> str:
    return "None" if w is None else f"a {dtype_name(w.dtype)} tensor"


# --- torch's RMSNorm arithmetic ---------------------------------------------------------


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

UNKNOWN_TORCH = (
    f"torch {torch.__version__}'s F.rms_norm rounds differently from torch 2.13's "
    "arithmetic the kernels reproduce; running the meaning"
)


def torch_arithmetic_reasons(convention: str) -> list[str]:
    """Why no path can take a ``"torch"``-convention norm on this torch (none: it can)."""
    if convention == "torch" and not torch_rms_norm_is_known():
        return [UNKNOWN_TORCH]
    return []
