"""What :func:`ditops.patch` was asked to do (:class:`PatchOptions`), validated when made."""

from __future__ import annotations

from dataclasses import dataclass, fields

from ditops.attention.schedule import BlockSparseConfig
from ditops.config import PRECISIONS
from ditops.integrations.shared.refusals import PatchError


@dataclass(frozen=True)
class PatchOptions:
    """What :func:`ditops.patch` was asked to do, validated when made.

    Attributes:
        norms: swap norms and, where the family supports it, fuse each block's
            norm / modulation / residual chain.
        attention: ``None`` (attention as it is) or a :class:`BlockSparseConfig`.
        precision: ``"exact"``, ``"fast"`` or ``None`` (follow ``DITOPS_PRECISION``).
    """

    norms: bool = True
    attention: BlockSparseConfig | None = None
    precision: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.norms, bool):
            raise PatchError(f"patch: norms must be True or False, got {self.norms!r}")
        if self.attention is not None and not isinstance(self.attention, BlockSparseConfig):
            hint = ""
            if isinstance(self.attention, (int, float)) and not isinstance(self.attention, bool):
                hint = f" (for sparsity {self.attention}: ditops.BlockSparseConfig(sparsity=...))"
            raise PatchError(
                "patch: attention must be None or a ditops.BlockSparseConfig, got "
                f"{type(self.attention).__name__} {self.attention!r}{hint}"
            )
        if self.precision is not None and self.precision not in PRECISIONS:
            raise PatchError(
                f"patch: precision must be one of {PRECISIONS} or None, got {self.precision!r}"
            )

    def describe(self) -> str:
        return ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))
