"""Rows of BNSD-viewed tensors for the gathered block-sparse kernel: gathering the
selected blocks of keys, values and queries into one buffer, scattering outputs back,
and the scratch buffers kept between calls
(:mod:`ditops.kernels.cpu.block_sparse_attention`)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import NamedTuple

import torch


class Rows:
    """A BNSD-viewed tensor as rows of its last dim, addressed by (batch, head, token).

    Rows are read through one ``[M, D]`` view when the strides allow it (unit stride
    on D, the others multiples of D: contiguous BNSD or BSND, or a slice of a packed
    qkv tensor); otherwise the tensor is copied to contiguous BNSD first. When a head's
    tokens are consecutive rows in whole blocks (contiguous BNSD, length a multiple of
    the block), ``blocks`` views them as ``[M / block, block * D]``: one index per block
    instead of one per token.
    """

    def __init__(self, x: torch.Tensor, block_size: int) -> None:
        dim = int(x.shape[-1])
        sizes = [int(s) for s in x.shape]
        strides = [int(s) for s in x.stride()]
        usable = (strides[3] == 1 or sizes[3] == 1) and all(
            s % dim == 0 or n == 1 for s, n in zip(strides[:3], sizes[:3])
        )
        if not usable:
            x = x.contiguous()
            strides = [int(s) for s in x.stride()]
        rb, rn, rs = (s // dim if n > 1 else 0 for s, n in zip(strides[:3], sizes[:3]))
        rows = 1 + rb * (sizes[0] - 1) + rn * (sizes[1] - 1) + rs * (sizes[2] - 1)
        self.dim, self.block = dim, block_size
        self.rb, self.rn, self.rs = rb, rn, rs
        self.flat = x.as_strided((rows, dim), (dim, 1), x.storage_offset())
        self.blocks: torch.Tensor | None = None
        aligned = rows % block_size == 0 and rb % block_size == 0 and rn % block_size == 0
        if (rs == 1 or sizes[2] == 1) and aligned:
            self.blocks = self.flat.view(rows // block_size, block_size * dim)

    def start(self, b: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        """Row of token 0 of (batch b, head n)."""
        return b * self.rb + n * self.rn

    def _ids(self, parts: list[Part]) -> tuple[torch.Tensor, bool]:
        """Indices of the parts' rows: of whole blocks in ``blocks`` when every part is
        made of whole blocks and the view exists (True), else of rows in ``flat``."""
        if self.blocks is not None and all(p.length == p.blocks.shape[1] * self.block
                                           for p in parts):  # fmt: skip
            ids = [((p.start // self.block)[:, None] + p.blocks).reshape(-1) for p in parts]
            return torch.cat(ids) if len(ids) > 1 else ids[0], True
        rows = []
        for p in parts:
            pos = p.blocks[:, :, None] * self.block + torch.arange(self.block)
            pos = pos.reshape(p.blocks.shape[0], -1)[:, : p.length]
            rows.append((p.start[:, None] + pos * self.rs).reshape(-1))
        return torch.cat(rows) if len(rows) > 1 else rows[0], False

    def _run(self, ids: torch.Tensor) -> int | None:
        """The first index when ``ids`` are consecutive, else None."""
        first = int(ids[0])
        return first if bool((ids == torch.arange(first, first + ids.numel())).all()) else None

    def gather(self, parts: list[Part], buf: torch.Tensor) -> torch.Tensor:
        """The parts' rows one after the other, ``[sum(rows * length), D]``: one copy
        into ``buf``, or a view when they are consecutive whole blocks."""
        ids, whole = self._ids(parts)
        total = sum(int(p.start.shape[0]) * p.length for p in parts)
        if whole:
            first = self._run(ids)
            if first is not None:
                return self.blocks[first : first + ids.numel()].view(-1, self.dim)
            out = buf[: total * self.dim].view(-1, self.block * self.dim)
            return torch.index_select(self.blocks, 0, ids, out=out).view(-1, self.dim)
        out = buf[: total * self.dim].view(total, self.dim)
        return torch.index_select(self.flat, 0, ids, out=out)

    def scatter(self, parts: list[Part], pieces: list[torch.Tensor]) -> None:
        """Write ``cat(pieces)`` to the parts' rows (the inverse of :meth:`gather`)."""
        ids, whole = self._ids(parts)
        if whole:
            first = self._run(ids)
            if first is not None:
                dest = self.blocks[first : first + ids.numel()].view(-1, self.dim)
                if len(pieces) > 1:
                    torch.cat(pieces, out=dest)
                else:
                    dest.copy_(pieces[0])
                return
            src = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
            self.blocks.index_copy_(0, ids, src.view(ids.numel(), -1))
            return
        self.flat.index_copy_(0, ids, torch.cat(pieces) if len(pieces) > 1 else pieces[0])


class Part(NamedTuple):
    """Rows to gather: for each row, the whole blocks ``blocks[i]`` (ascending) of the
    sequence starting at row ``start[i]``, ``length`` rows of them (the last block may
    be partial)."""

    start: torch.Tensor
    blocks: torch.Tensor
    length: int


#: Scratch buffers kept between calls (one set, taken by one call at a time): fresh
#: ones would page-fault on every call (field notes, glibc malloc).
_kept: list[torch.Tensor] = []
_kept_lock = threading.Lock()


@contextlib.contextmanager
def workspace(*wants: tuple[int, torch.dtype]) -> Iterator[list[torch.Tensor]]:
    """Flat buffers of at least ``numel`` elements of ``dtype``, reused across calls."""
    if not _kept_lock.acquire(blocking=False):
        # Another thread holds the kept set: this call gets its own.
        yield [torch.empty(numel, dtype=dtype) for numel, dtype in wants]
        return
    try:
        for i, (numel, dtype) in enumerate(wants):
            if i == len(_kept):
                _kept.append(torch.empty(0, dtype=dtype))
            kept = _kept[i]
            # One made under inference_mode cannot be written outside it: made afresh.
            stale = kept.is_inference() and not torch.is_inference_mode_enabled()
            if kept.dtype != dtype or kept.numel() < numel or stale:
                _kept[i] = torch.empty(0)  # free the old one first
                _kept[i] = torch.empty(numel, dtype=dtype)
        yield [_kept[i] for i in range(len(wants))]
    finally:
        _kept_lock.release()


def release_workspace() -> None:
    """Free the scratch buffers kept between calls."""
    with _kept_lock:
        _kept.clear()
