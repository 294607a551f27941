"""Walking the rows of a modulated call in blocks, for the CPU modulation kernels.

Both chains' kernels (:mod:`ditops.kernels.cpu.modulation`, Wan's, and
:mod:`ditops.kernels.cpu.adaln`, FLUX's) take activations ``[B, L, C]`` and modulations
None, 0-d or ``[Bm, G, C]`` views (token ``l`` uses row ``l // (L // G)``), and process
them in blocks of rows that share their modulation rows.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def _groups(*mods: torch.Tensor | None) -> int:
    """The common row count G of the 3-D modulations (1 when none is per frame/token)."""
    g = 1
    for m in mods:
        if m is not None and m.dim() == 3 and m.shape[1] > 1:
            g = m.shape[1]
    return g


def per_token(m: torch.Tensor | None, L: int) -> bool:
    """A ``[Bm, L, C]`` modulation: one row per token."""
    return m is not None and m.dim() == 3 and m.shape[1] == L and L > 1


Rows = dict[str, torch.Tensor | None]


def walk_rows(B: int, L: int, step: int, mods: Rows) -> Iterator[tuple[int, int, int, int, Rows]]:
    """The row blocks of a call: ``(b, g, l0, l1, rows)``.

    Rows ``l0:l1`` of sample ``b`` all lie in group ``g`` (a frame; 0 without per-frame
    modulation) and use the modulation rows ``rows[name]``: 0-d (a scalar), ``[C]`` or,
    per token, ``[l1 - l0, C]``. Views are made once per (sample, group) where they can
    be: the Python work per block is a few slices.
    """
    G = _groups(*mods.values())
    seg = L if G in (1, L) else L // G
    for b in range(B):
        for g, s0 in enumerate(range(0, L, seg)):
            fixed: Rows = {}
            token: dict[str, torch.Tensor] = {}
            for name, m in mods.items():
                if m is None or m.dim() == 0:
                    fixed[name] = m
                    continue
                mb = m[b if m.shape[0] > 1 else 0]
                if per_token(m, L):
                    token[name] = mb
                else:
                    fixed[name] = mb[0 if m.shape[1] == 1 else g]
            s1 = min(s0 + seg, L)
            for l0 in range(s0, s1, step):
                l1 = min(l0 + step, s1)
                rows = dict(fixed)
                for name, mb in token.items():
                    rows[name] = mb[l0:l1]
                yield b, g, l0, l1, rows
