"""The arguments of the DiT modulation ops, both chains: checked once, normalised to one form.

Wan's chain (:mod:`ditops.ops.modulation_fp32`) and FLUX's/HunyuanVideo's
(:mod:`ditops.ops.modulation_model_dtype`) take the same activations and modulations;
this module checks them (:func:`prepare_activations`, :func:`check_modulation`), holds
the call record both chains share (:class:`ModulationCall`) and turns its modulations
into the operands the kernels take (:meth:`ModulationCall.rows` and friends).

Shape rule. Activations ``x`` (and ``residual``) are ``[B, L, C]`` (batch, tokens,
channels) or ``[L, C]``, taken as ``B = 1``; the output always has the input's shape.
Each modulation tensor (``scale``, ``shift``, ``gate``) is one of

* a scalar: a Python number or a 0-d tensor,
* ``[C]``: one row for every token,
* ``[B, 1, C]``: one row per sample (Wan2.1, Wan2.2 A14B, FLUX),
* ``[B, L, C]``: one row per token (Wan2.2 TI2V-5B),
* ``[B, F, 1, C]``: one row per frame, ``L`` divisible by ``F`` (token ``l`` is in frame
  ``l // (L // F)``),

where the leading ``B`` may also be 1 (shared by the batch). Its dtype is fp32 or the
model dtype (the activations' or the output's). Every per-frame or per-token
modulation of one call must have the same number of rows ``G`` (they describe the same
tokens).

Kernels see one form: a ``[Bm, G, C]`` view (no copy; strides may be 0), ``Bm`` in
``{1, B}``, ``G`` in ``{1, F, L}``, token ``l`` using row ``l // (L // G)``. The exact CPU
kernels also need to know which arguments were scalars, because eager PyTorch promotes
a 0-d operand differently from a dimensioned one (``bf16_tensor * fp32_scalar`` stays
bf16); :func:`exact_operand` keeps them 0-d.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ditops.core.calls import OpCall
from ditops.core.checks import FLOATS, dtype_name

ModulationArg = torch.Tensor | float | int | None

ACCEPTED_SHAPES = (
    "a scalar (Python number or 0-d tensor), [C], [B, 1, C], [B, L, C] (one row per token) "
    "or [B, F, 1, C] (one row per frame, L divisible by F), where the leading B may be 1"
)
_ACTIVATION_DTYPES = (*FLOATS, torch.float64)


def rows3(x: object, op: str, name: str = "x") -> torch.Tensor:
    """``x`` as a ``[B, L, C]`` view: ``[B, L, C]`` as it is, ``[L, C]`` as ``[1, L, C]``.

    TypeError for a non-tensor or a non-float dtype, ValueError for another rank.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a tensor, got {type(x).__name__}")
    if x.dtype not in _ACTIVATION_DTYPES:
        raise TypeError(
            f"{op}: {name} has dtype {dtype_name(x.dtype)}; expected float32, bfloat16, "
            "float16 or float64"
        )
    if x.dim() == 3:
        return x
    if x.dim() == 2:
        return x.unsqueeze(0)
    raise ValueError(
        f"{op}: {name} must be [B, L, C] or [L, C] (taken as B = 1), got shape {tuple(x.shape)}"
    )


def check_param(p: object, x3: torch.Tensor, op: str, name: str) -> None:
    """A LayerNorm weight or bias: None or a float ``[C]`` tensor on ``x``'s device."""
    if p is None:
        return
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a tensor or None, got {type(p).__name__}")
    if not p.is_floating_point():
        raise TypeError(f"{op}: {name} has dtype {dtype_name(p.dtype)}; expected a float dtype")
    C = x3.shape[-1]
    if tuple(p.shape) != (C,):
        raise ValueError(f"{op}: {name} must have shape [C] = [{C}], got {tuple(p.shape)}")
    if p.device != x3.device:
        raise ValueError(f"{op}: {name} is on {p.device} but the activations are on {x3.device}")


def check_out_dtype(out_dtype: object, op: str) -> None:
    if out_dtype is None:
        return
    if not isinstance(out_dtype, torch.dtype) or out_dtype not in _ACTIVATION_DTYPES:
        raise TypeError(
            f"{op}: out_dtype must be None or one of float32, bfloat16, float16, float64; "
            f"got {out_dtype!r}"
        )


@dataclass(frozen=True)
class Modulation:
    """One validated modulation argument."""

    #: The argument as given (``forward_native`` uses it unchanged).
    value: ModulationArg
    #: Rows: 0 for None, 1 for scalars, ``[C]`` and ``[B, 1, C]``, else F or L.
    groups: int
    #: Leading batch of the argument (1 when shared by the batch).
    batch: int

    @property
    def is_none(self) -> bool:
        return self.value is None

    @property
    def is_scalar(self) -> bool:
        v = self.value
        return v is not None and (not isinstance(v, torch.Tensor) or v.dim() == 0)

    def tensors(self) -> Iterator[torch.Tensor]:
        """The argument, when it is a tensor (read by the call record's checks)."""
        if isinstance(self.value, torch.Tensor):
            yield self.value


#: A modulation left out (``scale``/``shift`` None, or an op without a gate).
ABSENT = Modulation(None, 0, 1)


def check_modulation(
    value: object,
    x3: torch.Tensor,
    op: str,
    name: str,
    dtypes: tuple[torch.dtype, ...],
) -> Modulation:
    """Validate one modulation argument against activations ``x3`` ([B, L, C]).

    ``dtypes`` are the allowed tensor dtypes (fp32 and the model dtype). Python bools
    and non-numbers are a TypeError; shapes other than :data:`ACCEPTED_SHAPES`, a
    wrong ``C``, ``B`` or ``F`` and another device are a ValueError.
    """
    if value is None:
        return ABSENT
    B, L, C = x3.shape
    if isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor)):
        raise TypeError(
            f"{op}: {name} must be a tensor, a Python int/float or None, got {type(value).__name__}"
        )
    if not isinstance(value, torch.Tensor):
        return Modulation(value, 1, 1)
    if value.dtype not in dtypes:
        allowed = " or ".join(dict.fromkeys(dtype_name(d) for d in dtypes))
        raise TypeError(
            f"{op}: {name} has dtype {dtype_name(value.dtype)}; expected {allowed} "
            "(fp32 or the model dtype)"
        )
    if value.device != x3.device:
        raise ValueError(
            f"{op}: {name} is on {value.device} but the activations are on {x3.device}"
        )
    shape = tuple(value.shape)

    def bad(why: str) -> ValueError:
        return ValueError(
            f"{op}: {name} of shape {list(shape)} does not fit activations [B, L, C] = "
            f"{[B, L, C]} ({why}); accepted modulation shapes: {ACCEPTED_SHAPES}"
        )

    if value.dim() == 0:
        return Modulation(value, 1, 1)
    if shape[-1] != C:
        raise bad(f"last dim {shape[-1]} != C = {C}")
    if value.dim() == 1:
        return Modulation(value, 1, 1)
    if value.dim() not in (3, 4):
        raise bad(f"rank {value.dim()} is not accepted")
    if shape[0] not in (1, B):
        raise bad(f"leading dim {shape[0]} is neither 1 nor B = {B}")
    if value.dim() == 3:
        if shape[1] not in (1, L):
            raise bad(f"dim 1 is {shape[1]}: expected 1 (per sample) or L = {L} (per token)")
        return Modulation(value, shape[1], shape[0])
    frames = shape[1]
    if shape[2] != 1:
        raise bad(f"a per-frame modulation is [B, F, 1, C]; dim 2 is {shape[2]}, not 1")
    if frames == 0 or L % frames != 0:
        raise bad(f"L = {L} is not divisible by F = {frames}")
    return Modulation(value, frames, shape[0])


def common_groups(op: str, mods: dict[str, Modulation], L: int) -> int:
    """The one G > 1 the per-frame/per-token modulations share (1 when there is none)."""
    found = {name: m.groups for name, m in mods.items() if m.groups > 1}
    distinct = set(found.values())
    if len(distinct) > 1:
        listed = ", ".join(f"{n} has {g}" for n, g in found.items())
        raise ValueError(
            f"{op}: per-frame/per-token modulations of one call must have the same number of "
            f"rows; {listed} (L = {L})"
        )
    return distinct.pop() if distinct else 1


def modulation_rows(
    mod: Modulation, x3: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor | None:
    """A validated modulation as a ``[Bm, G, C]`` view for kernels (strides may be 0).

    No copy of a tensor argument; a Python number becomes a one-element tensor of
    ``dtype`` on ``x3``'s device, viewed with stride 0. None stays None.
    """
    v = mod.value
    if v is None:
        return None
    C = x3.shape[-1]
    if not isinstance(v, torch.Tensor):
        v = torch.full((), float(v), dtype=dtype, device=x3.device)
    if v.dim() == 0:
        return v.reshape(1, 1, 1).expand(1, 1, C)
    if v.dim() == 1:
        return v.unsqueeze(0).unsqueeze(0)
    if v.dim() == 3:
        return v
    return v.squeeze(2)


def exact_operand(mod: Modulation, x3: torch.Tensor) -> torch.Tensor | None:
    """A validated modulation in the form the exact CPU kernels take.

    Scalars become 0-d tensors, so chunked eager ops promote them as the eager
    expression did: a Python number becomes a 0-d float64 tensor, which PyTorch
    treats exactly like the number (same result dtype, same value, bitwise). Others
    are the ``[Bm, G, C]`` view of :func:`modulation_rows`.
    """
    v = mod.value
    if v is None:
        return None
    if not isinstance(v, torch.Tensor):
        return torch.tensor(v, dtype=torch.float64, device=x3.device)
    if v.dim() == 0:
        return v
    return modulation_rows(mod, x3)


def grouped_view(
    x3: torch.Tensor, groups: int, mod: Modulation
) -> tuple[torch.Tensor, ModulationArg]:
    """``x3`` as ``[B, G, L // G, C]`` and ``mod`` in a form that broadcasts against it.

    This is how the eager expression reads a per-frame modulation (Wan-style
    ``x.unflatten(1, (F, -1)) * scale``); elementwise ops give the same bits whatever the
    view. Scalars and ``[C]`` are returned unchanged.
    """
    v = mod.value
    if groups == 1 and (not isinstance(v, torch.Tensor) or v.dim() in (0, 1, 3)):
        # One group: ``[B, L, C]`` against ``[C]`` or ``[B, 1, C]`` broadcasts as the
        # grouped view does (same operands, same bits), without the views' cost per call.
        return x3, v
    B, L, C = x3.shape
    x4 = x3.reshape(B, groups, L // groups if groups else 0, C)
    if not isinstance(v, torch.Tensor) or v.dim() <= 1:
        return x4, v
    rows = modulation_rows(mod, x3)
    assert rows is not None
    return x4, rows.unsqueeze(2)


# --- the call record both chains share ------------------------------------------------------


@dataclass(slots=True)
class ModulationCall(OpCall):
    """One checked call of a modulation op: ``[B, L, C]`` views, the modulations (each
    :data:`ABSENT` where the op or the call has none) and their common row count."""

    x: torch.Tensor  # [B, L, C]
    residual: torch.Tensor | None  # [B, L, C]; None: the op has no residual
    gate: Modulation
    scale: Modulation
    shift: Modulation
    groups: int
    eps: float
    shape: torch.Size  # of the activations: every output takes it
    weight: torch.Tensor | None = None  # the LayerNorm's, as given (Wan's chain only)
    bias: torch.Tensor | None = None
    out_dtype: torch.dtype | None = None  # of the modulated output (Wan's chain only)

    def tensors(self) -> list[torch.Tensor]:
        """The call's tensors, listed directly (it runs on every call: no field walk)."""
        found = [t for t in (self.x, self.residual, self.weight, self.bias) if t is not None]
        for m in (self.gate, self.scale, self.shift):
            if isinstance(m.value, torch.Tensor):
                found.append(m.value)
        return found

    @property
    def model(self) -> torch.Tensor:
        """The tensor whose dtype is the model's: the residual, else x."""
        return self.residual if self.residual is not None else self.x

    def mods(self) -> dict[str, Modulation]:
        return {"gate": self.gate, "scale": self.scale, "shift": self.shift}

    def grouped(self, h: torch.Tensor, name: str) -> tuple[torch.Tensor, ModulationArg]:
        """:func:`grouped_view` of ``h`` ([B, L, C]) and the modulation ``name``."""
        return grouped_view(h, self.groups, getattr(self, name))

    def rows(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
        """The modulation ``name`` as the ``[Bm, G, C]`` view kernels take (None: absent)."""
        return modulation_rows(getattr(self, name), self.x, dtype)

    def rows_or_zeros(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """As :meth:`rows`, zeros of ``dtype`` when absent (``1 + 0`` and ``+ 0`` change no
        value; the Triton LayerNorm epilogue takes both scale and shift or neither)."""
        rows = self.rows(name)
        if rows is None:
            return torch.zeros((1, 1, 1), dtype=dtype, device=self.x.device)
        return rows

    def exact_operand(self, name: str) -> torch.Tensor | None:
        """:func:`exact_operand` of the modulation ``name``."""
        return exact_operand(getattr(self, name), self.x)


def prepare_activations(
    op: str, x: object, residual: object
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Size]:
    """``x`` (and ``residual``) as ``[B, L, C]`` views, checked to match, and the shape the
    outputs take."""
    x3 = rows3(x, op, "x")
    if residual is None:
        return x3, None, x.shape  # type: ignore[attr-defined]
    res3 = rows3(residual, op, "residual")
    if tuple(residual.shape) != tuple(x.shape):  # type: ignore[attr-defined]
        raise ValueError(
            f"{op}: x has shape {tuple(x.shape)}; expected the residual's shape "  # type: ignore[attr-defined]
            f"{tuple(residual.shape)}"  # type: ignore[attr-defined]
        )
    if x3.device != res3.device:
        raise ValueError(f"{op}: x is on {x3.device}; expected the residual's device {res3.device}")
    return x3, res3, residual.shape  # type: ignore[attr-defined]


def check_modulations(
    op: str,
    model: torch.Tensor,
    gate: tuple[ModulationArg, tuple[torch.dtype, ...]] | None,
    scale_shift: tuple[ModulationArg, ModulationArg, tuple[torch.dtype, ...]] | None,
) -> tuple[Modulation, Modulation, Modulation, int]:
    """``(gate, scale, shift, groups)``: each given modulation checked against ``model``
    ([B, L, C]) with its allowed dtypes; one the op does not take is :data:`ABSENT`."""
    g = ABSENT if gate is None else check_modulation(gate[0], model, op, "gate", gate[1])
    s = t = ABSENT
    if scale_shift is not None:
        scale, shift, dtypes = scale_shift
        s = check_modulation(scale, model, op, "scale", dtypes)
        t = check_modulation(shift, model, op, "shift", dtypes)
    mods = {"gate": g, "scale": s, "shift": t}
    return g, s, t, common_groups(op, mods, model.shape[1])
