"""Argument checks every op shares, and the names of dtypes in messages.

Each check raises ``TypeError`` (wrong kind of value) or ``ValueError`` (wrong value),
naming the op, the argument, what it got and what is expected; each returns the value
normalised (a float, an int), so a ``prepare`` reads as one line per argument.
"""

from __future__ import annotations

import argparse
import math
import numbers
import operator
from collections.abc import Iterable

import torch

#: The floating dtypes ditops' ops take.
FLOATS: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
#: The half-precision ones (NPU kernels take these only).
HALF: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)
from ditops.config import PRECISIONS  # noqa: E402 - one list of precisions


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    """``"bfloat16/float16/float32"``: sorted, for messages."""
    return "/".join(sorted(dtype_name(d) for d in dtypes))


def check_tensor(
    op: str, name: str, value: object, dtypes: Iterable[torch.dtype] = FLOATS
) -> torch.Tensor:
    """A tensor whose dtype is one of ``dtypes``."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a tensor, got {type(value).__name__}")
    allowed = tuple(dtypes)
    if value.dtype not in allowed:
        raise TypeError(
            f"{op}: {name} dtype {dtype_name(value.dtype)} not supported; expected "
            f"{', '.join(dtype_name(d) for d in allowed)}"
        )
    return value


def as_int(value: object) -> int | None:
    """``value`` as a Python int when it is an integer of any type (``int``, numpy's,
    a 0-d integer tensor: what ``operator.index`` takes), else None; a bool is not one."""
    if type(value) is int:
        return value
    if isinstance(value, bool) or (hasattr(value, "dtype") and "bool" in str(value.dtype)):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def _numpy_scalar(value: object) -> object:
    """A numpy scalar or 0-d array as its Python value (``np.array(0.5)`` -> 0.5, as
    ``operator.index`` already takes a 0-d integer one); anything else as it is. Tensors
    are not unwrapped: a float tensor is refused where a setting is asked."""
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        return value.item()  # type: ignore[attr-defined]
    return value


def as_bool(value: object) -> bool | None:
    """``value`` as a Python bool when it is one (numpy's ``bool_`` and 0-d bool arrays
    too), else None; an int is not one."""
    value = _numpy_scalar(value)
    return value if type(value) is bool else None


def as_real(value: object) -> float | None:
    """``value`` as a Python float when it is a real number (an integer as :func:`as_int`
    takes it, or a ``numbers.Real``: float, numpy's scalars and 0-d arrays) that a float
    holds exactly, else None; a bool is not one."""
    if type(value) is float:
        return value
    value = _numpy_scalar(value)
    number = as_int(value)
    if number is not None:
        result = float(number)
        return result if int(result) == number else None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    result = float(value)
    if not math.isnan(result) and result != value:
        return None  # not exactly a float (a Fraction such as 1/3)
    return result


def check_eps(op: str, eps: object) -> float:
    """A real number (not a bool), as a float."""
    if type(eps) is float:  # the common case, before the slower abstract-class check
        return eps
    value = as_real(eps)
    if value is None:
        raise TypeError(f"{op}: eps must be a real number, got {type(eps).__name__}")
    return value


def check_flag(op: str, name: str, value: object) -> bool:
    """A bool (numpy's too: :func:`as_bool`), as a Python bool."""
    flag = as_bool(value)
    if flag is None:
        raise TypeError(f"{op}: {name} must be a bool, got {type(value).__name__} {value!r}")
    return flag


def check_int(op: str, name: str, value: object, minimum: int = 1) -> int:
    """An int (not a bool; numpy's too: :func:`as_int`) of at least ``minimum``."""
    number = as_int(value)
    if number is None or number < minimum:
        what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{op}: {name} must be {what}, got {value!r}")
    return number


def check_number(
    op: str,
    name: str,
    value: object,
    *,
    low: float,
    high: float | None = None,
    closed_low: bool = False,
) -> float:
    """A real number (not a bool) in ``(low, high]`` (``[low, high]`` with ``closed_low``)."""
    v = as_real(value)
    ok = v is not None and (v >= low if closed_low else v > low) and (high is None or v <= high)
    if not ok:
        lo = "[" if closed_low else "("
        hi = "inf)" if high is None else f"{high}]"
        raise ValueError(f"{op}: {name} must be a number in {lo}{low}, {hi}, got {value!r}")
    return v  # type: ignore[return-value]


def check_choice(op: str, name: str, value: object, choices: Iterable[object]) -> object:
    allowed = tuple(choices)
    if value not in allowed:
        raise ValueError(f"{op}: {name} must be one of {allowed}, got {value!r}")
    return value


def check_precision(value: object, owner: str = "precision") -> str | None:
    """``"fast"``, ``"exact"`` or None (follow the settings)."""
    if value is not None and (not isinstance(value, str) or value not in PRECISIONS):
        raise ValueError(f"{owner} must be 'fast', 'exact' or None, got {value!r}")
    return value


def positive_seconds(text: str) -> float:
    """argparse type of ``--min-seconds``: a positive finite number of seconds (a bad
    value exits 2 with argparse's message before anything runs)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value
