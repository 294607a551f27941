"""adaLN-Zero in the model dtype on CPU: FLUX's modulated LayerNorm and gated residual.

Inputs are validated by :mod:`ditops.ops.modulation_model_dtype`: activations
``[B, L, C]`` of one dtype (fp32, bf16 or fp16), modulations ``None`` or ``[Bm, G, C]``
views of that dtype (token ``l`` uses row ``l // (L // G)``). The arithmetic each mode
reproduces is stated in the op's docstring.

* ``exact`` runs eager's operations, in eager's dtype, on blocks of rows: ``F.layer_norm``
  of a block (ATen normalises each row on its own: a block gives the bits of the whole
  tensor), the product written straight into the output block, the sum added in place
  (in-place and ``out=`` variants round as the plain operations do). ``1 + scale`` is
  computed once per call, in scale's dtype, as eager does. The residual's product goes
  to one scratch block reused by every block, the sum straight into the output.
* ``fast`` folds the modulation into LayerNorm's affine parameters, ``w = 1 + scale`` and
  ``b = shift`` widened to fp32, and lets ATen's mixed-dtype LayerNorm (bf16/fp16 in and
  out, fp32 inside) do everything in one pass, rounded once; with one modulation row for
  the whole batch that is a single call. The residuals are the exact ones (nothing
  faster keeps their bits), per-token modulation and fp32 activations take the exact
  kernel (fp32 shows every reordering).

What this buys on a CPU depends on the machine. Where bf16 arithmetic is costly (AVX2
without AMX: ATen converts every bf16 operand) the blocks gain little over eager and the
folded LayerNorm is the saving; where it is cheap the blocks save the passes over memory
(five of six for the modulated norm). Measurements: ``benchmarks/cpu/flux.txt``.

Each kernel is a ``torch.library`` custom op (:func:`~ditops.kernels.opaque.opaque_op`),
so ``torch.compile`` calls it as one opaque op instead of unrolling the block loop.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ditops.kernels.cpu import blocks, workers
from ditops.kernels.cpu.blocks import Block, Rows, per_token, walk_rows
from ditops.kernels.cpu.modulation import rows_per_block
from ditops.kernels.opaque import opaque_op


def _one_plus(scale: Tensor | None, L: int) -> Rows:
    """``1 + scale`` as eager computes it (in scale's dtype), once per call; a per-token
    scale is left to the blocks (the sum would be a whole extra pass)."""
    if scale is None:
        return {"one_plus": None}
    if per_token(scale, L):
        return {"scale": scale}
    return {"one_plus": 1 + scale}


def _modulate_block(y_in: Tensor, rows: Rows, eps: float, out: Tensor) -> None:
    """``out = LN(y_in) * (1 + scale) + shift`` for one block, with eager's roundings."""
    y = F.layer_norm(y_in, (y_in.shape[-1],), None, None, eps)
    s1 = rows.get("one_plus")
    if "scale" in rows:
        s1 = 1 + rows["scale"]  # type: ignore[operator]
    if s1 is not None:
        torch.mul(y, s1, out=out)
    else:
        out.copy_(y)
    t = rows.get("shift")
    if t is not None:
        out.add_(t)


def _residual_block(r: Tensor, x: Tensor, g: Tensor | None, tmp: Tensor, out: Tensor) -> None:
    """``out = r + g * x`` for one block, as eager rounds it (the product first)."""
    if g is None:
        torch.add(r, x, out=out)
        return
    torch.mul(g, x, out=tmp)
    torch.add(r, tmp, out=out)


def _modulate_exact(x: Tensor, scale: Tensor | None, shift: Tensor | None, eps: float) -> Tensor:
    B, L, C = x.shape
    out = torch.empty((B, L, C), dtype=x.dtype, device=x.device)
    mods = {**_one_plus(scale, L), "shift": shift}

    def body(scratch: blocks.Scratch) -> Callable[[Block], None]:
        def run(block: Block) -> None:
            b, _, l0, l1, rows = block
            _modulate_block(x[b, l0:l1], rows, eps, out[b, l0:l1])

        return run

    workers.run_items(list(walk_rows(B, L, rows_per_block(C), mods)), body)
    return out


def _folded(s: Tensor | None, t: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
    """LayerNorm's fp32 affine parameters for ``* (1 + s) + t``: ``1 + s`` in s's dtype
    (as eager rounds it), then widened exactly."""
    w = None if s is None else (1 + s).float()
    return w, (None if t is None else t.float())


def _modulate_fast(x: Tensor, scale: Tensor | None, shift: Tensor | None, eps: float) -> Tensor:
    B, L, C = x.shape
    if all(m is None or m.shape[:2] == (1, 1) for m in (scale, shift)):
        # One affine for every row: one mixed-dtype LayerNorm over the whole tensor.
        w, bb = _folded(
            None if scale is None else scale[0, 0], None if shift is None else shift[0, 0]
        )
        return F.layer_norm(x, (C,), w, bb, eps)
    out = torch.empty((B, L, C), dtype=x.dtype, device=x.device)
    params: dict[tuple[int, int], tuple[Tensor | None, Tensor | None]] = {}
    mods = {"scale": scale, "shift": shift}

    def body(scratch: blocks.Scratch) -> Callable[[Block], None]:
        def run(block: Block) -> None:
            b, g, l0, l1, rows = block
            if (b, g) not in params:  # two workers may both fold it: the same values
                params[(b, g)] = _folded(rows["scale"], rows["shift"])
            w, bb = params[(b, g)]
            out[b, l0:l1].copy_(F.layer_norm(x[b, l0:l1], (C,), w, bb, eps))

        return run

    workers.run_items(list(walk_rows(B, L, rows_per_block(C), mods)), body)
    return out


def _exact_only(x: Tensor, *mods: Tensor | None) -> bool:
    """Calls the fast kernel cannot take: fp32 (every reordering shows) or per-token rows."""
    return x.dtype == torch.float32 or any(per_token(m, x.shape[1]) for m in mods)


# --- the custom ops ---------------------------------------------------------------------------


@opaque_op("ditops::cpu_adaln_modulate")
def modulate(
    x: Tensor, scale: Tensor | None, shift: Tensor | None, eps: float, exact: bool
) -> Tensor:
    """``F.layer_norm(x) * (1 + scale) + shift`` in x's dtype for ``x`` [B, L, C].

    ``exact``: eager's bits; otherwise rounded once (see the module docstring).
    """
    if x.numel() == 0:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if exact or _exact_only(x, scale, shift):
        return _modulate_exact(x, scale, shift, eps)
    return _modulate_fast(x, scale, shift, eps)


@modulate.register_fake
def _(x, scale, shift, eps, exact):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@opaque_op("ditops::cpu_adaln_residual")
def residual(residual: Tensor, x: Tensor, gate: Tensor | None) -> Tensor:
    """``residual + gate * x`` in their dtype for [B, L, C] tensors (``gate`` None: no
    gating); eager's bits in both modes."""
    B, L, C = residual.shape
    out = torch.empty((B, L, C), dtype=residual.dtype, device=residual.device)
    if residual.numel() == 0:
        return out
    step = rows_per_block(C)

    def body(scratch: blocks.Scratch) -> Callable[[Block], None]:
        tmp = scratch.take(2, min(step, L), C, residual.dtype)

        def run(block: Block) -> None:
            b, _, l0, l1, rows = block
            r, xb, nb = residual[b, l0:l1], x[b, l0:l1], out[b, l0:l1]
            _residual_block(r, xb, rows["gate"], tmp[: l1 - l0], nb)

        return run

    workers.run_items(list(walk_rows(B, L, step, {"gate": gate})), body)
    return out


@residual.register_fake
def _(residual, x, gate):
    return torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)


@opaque_op("ditops::cpu_adaln_residual_modulate")
def residual_modulate(
    residual: Tensor,
    x: Tensor,
    gate: Tensor | None,
    scale: Tensor | None,
    shift: Tensor | None,
    eps: float,
    exact: bool,
) -> tuple[Tensor, Tensor]:
    """``new = residual + gate * x`` and ``LN(new) * (1 + scale) + shift``, in one walk
    over the rows; returns ``(modulated, new)``. The residual is eager's bits in both
    modes; the modulated output as in :func:`modulate`."""
    B, L, C = residual.shape
    out = torch.empty((B, L, C), dtype=residual.dtype, device=residual.device)
    new = torch.empty((B, L, C), dtype=residual.dtype, device=residual.device)
    if residual.numel() == 0:
        return out, new
    exact = exact or _exact_only(residual, scale, shift)
    step = rows_per_block(C)
    mods = {"gate": gate, **(_one_plus(scale, L) if exact else {"scale": scale}), "shift": shift}
    params: dict[tuple[int, int], tuple[Tensor | None, Tensor | None]] = {}

    def body(scratch: blocks.Scratch) -> Callable[[Block], None]:
        tmp = scratch.take(2, min(step, L), C, residual.dtype)

        def run(block: Block) -> None:
            b, g, l0, l1, rows = block
            nb = new[b, l0:l1]
            _residual_block(residual[b, l0:l1], x[b, l0:l1], rows["gate"], tmp[: l1 - l0], nb)
            if exact:
                _modulate_block(nb, rows, eps, out[b, l0:l1])
                return
            if (b, g) not in params:  # two workers may both fold it: the same values
                params[(b, g)] = _folded(rows["scale"], rows["shift"])
            w, bb = params[(b, g)]
            out[b, l0:l1].copy_(F.layer_norm(nb, (C,), w, bb, eps))

        return run

    workers.run_items(list(walk_rows(B, L, step, mods)), body)
    return out, new


@residual_modulate.register_fake
def _(residual, x, gate, scale, shift, eps, exact):
    def like() -> Tensor:
        return torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)

    return like(), like()
