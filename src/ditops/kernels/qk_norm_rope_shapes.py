"""The arguments of the RMSNorm and rotary-embedding ops: validated in one place.

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
    cast with ``.to(bf16)`` casts its rope buffers too).

Layouts (which elements form a pair)
    ``"interleaved"``: ``(x[2i], x[2i + 1])`` (Wan's processor; FLUX, CogVideoX and
    HunyuanDiT through ``apply_rotary_emb(..., use_real_unbind_dim=-1)``);
    ``"halves"``: ``(x[i], x[i + D/2])`` (``use_real_unbind_dim=-2``: Stable Audio,
    CogView4, Cosmos).

Kernels see the tables as four ``[Bt, L, D/2]`` views (no copy), ``(c1, s1, c2, s2)``: the
first member of pair ``i`` uses ``c1[i], s1[i]``, the second ``c2[i], s2[i]``
(:func:`pair_tables`).
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import torch

LAYOUTS = ("interleaved", "halves")
CONVENTIONS = ("torch", "diffusers")
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
LOW_PRECISION = (torch.bfloat16, torch.float16)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_tensor(t: object, op: str, name: str) -> torch.Tensor:
    """TypeError unless ``t`` is a tensor of a supported floating dtype."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in ACTIVATION_DTYPES:
        raise TypeError(
            f"{op}: {name} has dtype {_name(t.dtype)}; expected float32, bfloat16, float16 "
            "or float64"
        )
    return t


def check_choice(value: object, choices: tuple[str, ...], op: str, name: str) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(
            f"{op}: {name} must be one of {', '.join(map(repr, choices))}, got {value!r}"
        )
    return value


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
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"{op}: eps must be a real number or None, got {type(eps).__name__}")
    return float(eps)


def check_weight(w: object, n: int, x: torch.Tensor, op: str, name: str, what: str) -> None:
    """A norm weight: None or an fp32/bf16/fp16 (or x's dtype) ``[n]`` tensor on x's device."""
    if w is None:
        return
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a tensor or None, got {type(w).__name__}")
    if w.dtype not in (torch.float32, *LOW_PRECISION, x.dtype):
        raise TypeError(
            f"{op}: {name} has dtype {_name(w.dtype)}; expected float32, bfloat16 or float16"
        )
    if tuple(w.shape) != (n,):
        raise ValueError(f"{op}: {name} must have shape [{what}] = [{n}], got {list(w.shape)}")
    if w.device != x.device:
        raise ValueError(f"{op}: {name} is on {w.device} but the activations are on {x.device}")


def normed_dtype(x_dtype: torch.dtype, w_dtype: torch.dtype | None, convention: str) -> torch.dtype:
    """The dtype of the normalised tensor (and of the fused op's outputs).

    ``torch``: the input's (``F.rms_norm`` rounds its fp32 result to it). ``diffusers``:
    the input's without a weight; a bf16/fp16 weight's dtype (its ``RMSNorm`` rounds to
    the weight's dtype and multiplies there); with an fp32 weight, fp32 (the product of
    the fp32 normalised value and the weight, never rounded back).
    """
    if convention == "torch" or w_dtype is None:
        return x_dtype
    if w_dtype in LOW_PRECISION:
        return w_dtype
    return torch.promote_types(torch.float32, w_dtype)


def check_qk(x: object, op: str, name: str) -> torch.Tensor:
    """A ``[B, L, H, D]`` float tensor with an even ``D``."""
    t = check_tensor(x, op, name)
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
    c = check_tensor(cos, op, "cos")
    s = check_tensor(sin, op, "sin")
    if c.shape != s.shape:
        raise ValueError(
            f"{op}: cos has shape {list(c.shape)} but sin has {list(s.shape)}; expected the same"
        )
    if c.dtype != s.dtype:
        raise TypeError(
            f"{op}: cos has dtype {_name(c.dtype)} but sin has {_name(s.dtype)}; expected the same"
        )
    if c.dtype not in (torch.float32, x.dtype):
        raise TypeError(
            f"{op}: cos/sin have dtype {_name(c.dtype)}; expected float32 (as the models keep "
            f"them) or the activations' dtype {_name(x.dtype)}"
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


class PairTables(NamedTuple):
    """``[Bt, L, D/2]`` views: pair i's first member uses (c1, s1), its second (c2, s2)."""

    c1: torch.Tensor
    s1: torch.Tensor
    c2: torch.Tensor
    s2: torch.Tensor

    @property
    def paired(self) -> bool:
        """One angle per pair: both members read the same entries."""
        return self.c1 is self.c2 and self.s1 is self.s2


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (``-0.0`` is not ``0.0``; a NaN equals the same NaN)."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.view(ints), b.view(ints))


def pair_tables(cos3: torch.Tensor, sin3: torch.Tensor, D: int, layout: str) -> PairTables:
    """The four per-pair views of ``[Bt, L, Dt]`` tables.

    Full-width tables whose two members of every pair hold the same bits (all tables
    diffusers builds: ``repeat_interleave`` or ``cat`` of one angle per pair) are
    reduced to one angle per pair; the arithmetic then is the same bit for bit, and the
    kernels can use their faster form. The check reads the tables once (1/H of the
    activations' size).
    """
    h = D // 2
    if cos3.shape[-1] == h:
        return PairTables(cos3, sin3, cos3, sin3)
    if layout == "interleaved":
        c1, c2, s1, s2 = cos3[..., 0::2], cos3[..., 1::2], sin3[..., 0::2], sin3[..., 1::2]
    else:
        c1, c2, s1, s2 = cos3[..., :h], cos3[..., h:], sin3[..., :h], sin3[..., h:]
    if _bits_equal(c1, c2) and _bits_equal(s1, s2):
        return PairTables(c1, s1, c1, s1)
    return PairTables(c1, s1, c2, s2)
