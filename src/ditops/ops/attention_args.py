"""The two attention ops' call records, and the argument checks they share (q/k/v, layout,
heads, block size, scale)."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ditops.attention.layout import LAYOUTS, to_bnsd
from ditops.attention.selection import BlockSelection
from ditops.core.calls import OpCall
from ditops.core.checks import FLOATS, check_choice, check_int


def check_qkv(op: str, names: Sequence[str], tensors: Sequence[object]) -> None:
    """4-D float tensors of one dtype, on one device."""
    for name, t in zip(names, tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
        if t.dtype not in FLOATS:
            raise TypeError(
                f"{op}: {name} dtype {t.dtype} not supported; expected float32, bfloat16 or float16"
            )
        if t.dim() != 4:
            raise ValueError(
                f"{op}: {name} must be 4-D ([B, N, S, D] or [B, S, N, D]), got shape "
                f"{list(t.shape)}"
            )
    first = tensors[0]
    assert isinstance(first, torch.Tensor)
    for name, t in zip(names[1:], tensors[1:]):
        assert isinstance(t, torch.Tensor)
        if t.dtype != first.dtype:
            raise TypeError(f"{op}: {name} dtype {t.dtype} differs from {names[0]} {first.dtype}")
        if t.device != first.device:
            raise ValueError(f"{op}: {name} is on {t.device}, {names[0]} on {first.device}")


def check_layout(op: str, layout: object) -> str:
    return str(check_choice(op, "layout", layout, LAYOUTS))


def check_heads(op: str, q: torch.Tensor, k: torch.Tensor) -> None:
    """q/k as BNSD views: same batch and head dim, query heads a multiple of key heads."""
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"{op}: batch sizes differ: q {q.shape[0]}, k {k.shape[0]}")
    if min(q.shape[1], k.shape[1], q.shape[3]) < 1:  # (the scale D ** -0.5 needs D >= 1)
        raise ValueError(
            f"{op}: heads and head dim must be >= 1, got q heads {q.shape[1]}, k heads "
            f"{k.shape[1]}, head dim {q.shape[3]}"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"{op}: query heads ({q.shape[1]}) must be a multiple of key heads ({k.shape[1]})"
        )
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"{op}: head dims differ: q {q.shape[3]}, k {k.shape[3]}")


def check_block_size(op: str, block_size: object) -> int:
    return check_int(op, "block_size", block_size)


def check_scale(op: str, scale: object) -> float | None:
    """None (``D ** -0.5``) or a positive number."""
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not scale > 0:
        raise ValueError(f"{op}: scale must be None or a positive number, got {scale!r}")
    return float(scale)


def softmax_scale(qb: torch.Tensor, scale: float | None) -> float:
    """The softmax scale of BNSD ``qb``: ``scale``, default ``D ** -0.5``."""
    return int(qb.shape[3]) ** -0.5 if scale is None else scale


def from_bnsd(out: torch.Tensor, layout: str) -> torch.Tensor:
    """A BNSD result in ``layout`` (contiguous)."""
    return out if layout == "BNSD" else out.transpose(1, 2).contiguous()


@dataclass(slots=True)
class AttentionCall(OpCall):
    q: torch.Tensor  # as given, in ``layout``
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor  # [B, Nq, Qb, >=KVb], checked against counts
    counts: torch.Tensor
    layout: str
    scale: float | None
    causal: bool
    block_size: int

    @property
    def qb(self) -> torch.Tensor:
        return to_bnsd(self.q, self.layout)

    @property
    def kb(self) -> torch.Tensor:
        return to_bnsd(self.k, self.layout)

    @property
    def vb(self) -> torch.Tensor:
        return to_bnsd(self.v, self.layout)


@dataclass(slots=True)
class EstimateCall(OpCall):
    q: torch.Tensor  # as given, in ``layout``
    k: torch.Tensor
    qb: torch.Tensor  # BNSD views
    kb: torch.Tensor
    layout: str
    block_size: int
    stride: int
    scale: float | None
    sel: BlockSelection

    def score_scale(self) -> float:
        """Scores use ``scale / stride`` (``scale`` defaults to ``D ** -0.5``)."""
        return softmax_scale(self.qb, self.scale) / self.stride
