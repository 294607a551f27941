"""The arguments of the DiT modulation ops: validated in one place, normalised to one form.

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

from dataclasses import dataclass

import torch

ModulationArg = torch.Tensor | float | int | None

ACCEPTED_SHAPES = (
    "a scalar (Python number or 0-d tensor), [C], [B, 1, C], [B, L, C] (one row per token) "
    "or [B, F, 1, C] (one row per frame, L divisible by F), where the leading B may be 1"
)
_ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def rows3(x: object, op: str, name: str = "x") -> torch.Tensor:
    """``x`` as a ``[B, L, C]`` view: ``[B, L, C]`` as it is, ``[L, C]`` as ``[1, L, C]``.

    TypeError for a non-tensor or a non-float dtype, ValueError for another rank.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a tensor, got {type(x).__name__}")
    if x.dtype not in _ACTIVATION_DTYPES:
        raise TypeError(
            f"{op}: {name} has dtype {_dtype_name(x.dtype)}; expected float32, bfloat16, "
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
        raise TypeError(f"{op}: {name} has dtype {_dtype_name(p.dtype)}; expected a float dtype")
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
        return Modulation(None, 0, 1)
    B, L, C = x3.shape
    if isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor)):
        raise TypeError(
            f"{op}: {name} must be a tensor, a Python int/float or None, got {type(value).__name__}"
        )
    if not isinstance(value, torch.Tensor):
        return Modulation(value, 1, 1)
    if value.dtype not in dtypes:
        allowed = " or ".join(dict.fromkeys(_dtype_name(d) for d in dtypes))
        raise TypeError(
            f"{op}: {name} has dtype {_dtype_name(value.dtype)}; expected {allowed} "
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
    B, L, C = x3.shape
    x4 = x3.reshape(B, groups, L // groups if groups else 0, C)
    v = mod.value
    if not isinstance(v, torch.Tensor) or v.dim() <= 1:
        return x4, v
    rows = modulation_rows(mod, x3)
    assert rows is not None
    return x4, rows.unsqueeze(2)
