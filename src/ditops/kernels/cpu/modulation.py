"""DiT modulation on CPU: LayerNorm with scale/shift, the gated residual, and both fused.

Inputs are already validated and normalised (see :mod:`ditops.ops.modulation_args`):
activations ``[B, L, C]``, LayerNorm weight/bias fp32 ``[C]`` or None, each modulation
None, a 0-d tensor (a scalar, promoted as eager PyTorch promotes scalars) or a
``[Bm, G, C]`` view, token ``l`` using row ``l // (L // G)``.

Memory model (bf16 [8192, 5120], fp32 [B, 1, C] modulation): the eager chain
``(LN(x.float()) * (1 + scale) + shift).to(bf16)`` makes five passes over the whole
tensor, most of them in fp32. Both precisions here walk the rows in blocks whose fp32
temporaries stay in cache, so memory sees one read of each input and one write of each
output:

* ``exact`` runs the very eager ops, block by block. Every one of them is elementwise
  or normalises each row on its own, so the bits are those of the eager expression.
  Temporaries live in this thread's scratch blocks (:mod:`ditops.kernels.cpu.blocks`):
  in-place ops where that gives the same bits, ``out=`` variants for the low-precision
  intermediates eager rounds (``x * gate``, ``1 + scale``), and exact fp32 copies of
  low-precision per-token operands (a mixed-dtype op would allocate that copy itself,
  per block). LayerNorm's own output is kept off fresh pages as ``blocks`` explains,
  so no block-sized memory is allocated per block in either state of glibc's malloc.
* ``fast`` folds a per-sample or per-frame modulation into LayerNorm's affine
  parameters, ``w' = w * (1 + scale)``, ``b' = b * (1 + scale) + shift`` (fp32, one row
  of C each), and lets ATen's mixed-dtype LayerNorm (low-precision in and out, fp32
  inside, one pass) do everything; with one modulation row for the whole batch that is
  a single call over the whole tensor. Per-token modulation uses ``addcmul`` on fp32
  blocks. Rounded once to the output dtype; the fp32 intermediates are ordered
  differently from eager, so a few elements in 1e5 differ by 1 ulp (or by more, but
  within ~1e-6 absolute, where ``shift`` cancels the normalised value). The gated
  residual is the exact one in both modes (nothing faster to fold), and an fp32 output
  takes the exact kernel (fp32 shows every reordering).

Timings against eager and ``torch.compile``: ``benchmarks/cpu/modulation.txt`` (and
``modulation-malloc.txt`` for the allocator's states).

Each kernel is a ``torch.library`` custom op, so ``torch.compile`` calls it as one
opaque op instead of unrolling the block loop.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ditops.kernels.cpu import blocks, workers
from ditops.kernels.cpu.blocks import Block, Rows, per_token, walk_rows
from ditops.kernels.opaque import opaque_op

#: fp32 bytes per block of rows. Each block runs on one thread with one intra-op thread
#: (:mod:`ditops.kernels.cpu.workers`), so no parallel region waits on a descheduled worker
#: and the size is a matter of cache: the fused op's working set is about four blocks
#: (its scratch slots, LayerNorm's output, the rows in and out), which at 4 MiB spilled
#: out of a shared L3. Measured at Wan's bench shape (bf16 [8064, 1536], exact, one
#: thread, load 2.5-3.8, ``benchmarks/cpu/probes/wan_block_bytes.py``): 2 MiB ran the
#: fused op 1.10-1.16x and the modulated norm 1.01-1.23x the speed of 4 MiB; 1 MiB was
#: within noise of 2 MiB, 256 KiB 0.75-0.9x (per-call overhead).
_BLOCK_BYTES = 2 * 1024 * 1024


def rows_per_block(C: int) -> int:
    """Rows of ``C`` channels per block: :data:`_BLOCK_BYTES` of fp32."""
    return max(1, _BLOCK_BYTES // max(1, 4 * C))


class _Buffers:
    """The working blocks of one call, in this thread's scratch (nothing allocated per block).

    Slot 0 (fp32) holds the rows being normalised (the gated sum in the fused op); slot 1
    (fp32) an operand converted to fp32 (a low-precision residual or per-token
    modulation): an op mixing dtypes would allocate that copy itself, per block; slot 2
    a low-precision result eager rounds before using it (``x * gate``, ``1 + scale``).
    """

    def __init__(self, scratch: blocks.Scratch, rows: int, C: int) -> None:
        self._scratch = scratch
        self.rows = rows
        self.C = C
        self._full: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def get(self, slot: int, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[n, C]`` (``n`` at most the block's rows) of ``dtype`` in ``slot``."""
        full = self._full.get((slot, dtype))
        if full is None:
            full = self._full[slot, dtype] = self._scratch.take(slot, self.rows, self.C, dtype)
        return full if n == self.rows else full[:n]


def _plan(B: int, L: int, step: int, row_bytes: int) -> tuple[int, int]:
    """(rows per block, rows per LayerNorm call) for ``B`` samples of ``L`` rows whose
    LayerNorm output rows take ``row_bytes``."""
    block = min(step, L)
    piece = blocks.piece_rows(B * L, block, row_bytes)
    return blocks.block_step(step, piece), piece


def _f32_rows(t: torch.Tensor, bufs: _Buffers) -> torch.Tensor:
    """A low-precision block of rows as fp32 in slot 1 (widening is exact, so the op it
    feeds gives the bits it gives the low-precision operand); anything else (fp32, a
    scalar or one row, whose converted copy is small) as it is."""
    if t.dtype == torch.float32 or t.dim() < 2:
        return t
    return bufs.get(1, t.shape[0]).copy_(t)


def _one_plus(s: torch.Tensor, bufs: _Buffers) -> torch.Tensor:
    """``1 + s`` as eager computes it (in s's dtype); a per-token block in scratch, as fp32."""
    if s.dim() < 2:
        return 1 + s
    n = s.shape[0]
    if s.dtype == torch.float32:
        return torch.add(s, 1, out=bufs.get(1, n))
    rounded = torch.add(s, 1, out=bufs.get(2, n, s.dtype))
    return bufs.get(1, n).copy_(rounded)


# --- exact: the eager ops, block by block -----------------------------------------------


def _scale_operands(scale: torch.Tensor | None, L: int) -> Rows:
    """``1 + scale`` as eager computes it (in scale's dtype), once for the whole call;
    a per-token scale is left to the blocks (the sum would be a full extra pass)."""
    if scale is None:
        return {}
    if per_token(scale, L):
        return {"scale": scale}
    return {"one_plus": 1 + scale}


def _gated_sum_exact(
    rc: torch.Tensor, xc: torch.Tensor, g: torch.Tensor | None, bufs: _Buffers
) -> torch.Tensor:
    """residual.float() + x * gate for one block, in slot 0, with the bits of the eager
    expression.

    When ``x * gate`` is computed in fp32 (an fp32 gate or fp32 x) it is done in place in
    the block; a low-precision product (bf16 x times a bf16 or scalar gate) is rounded to
    its dtype first, as eager does. IEEE addition commutes, so adding the residual to
    the product gives the same bits as the eager order.
    """
    n = xc.shape[0]
    acc = bufs.get(0, n)
    if g is None:
        acc.copy_(xc)  # x * 1 == x: nothing to round
    elif torch.result_type(xc, g) == torch.float32:
        acc.copy_(xc)
        acc.mul_(_f32_rows(g, bufs))
    else:
        acc.copy_(torch.mul(xc, g, out=bufs.get(2, n, torch.result_type(xc, g))))
    acc.add_(_f32_rows(rc, bufs))  # a same-dtype add: a mixed one makes its own fp32 copy
    return acc


def _ln_mod_block_exact(
    y_in: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    rows: Rows,
    out: torch.Tensor,
    bufs: _Buffers,
    piece: int,
) -> None:
    """out = (LN(y_in) * (1 + scale) + shift).to(out.dtype) for one fp32 block, as eager.

    The normalised rows are LayerNorm's own output or slot 0 (``y_in`` may be slot 0);
    ``* (1 + scale)`` and ``+ shift`` are fp32 results either way, so in place they give
    the bits of the eager out-of-place ops.
    """
    y = blocks.layer_norm_rows(y_in, weight, bias, eps, piece, bufs.get(0, y_in.shape[0]))
    scale = rows.get("scale")
    s1 = rows.get("one_plus") if scale is None else _one_plus(scale, bufs)
    if s1 is not None:
        y.mul_(s1)
    t = rows.get("shift")
    if t is not None:
        y.add_(_f32_rows(t, bufs))
    out.copy_(y)  # rounds to nearest even, as .to() does


def _gated_residual_exact(
    residual: torch.Tensor, x: torch.Tensor, gate: torch.Tensor | None
) -> torch.Tensor:
    B, L, C = residual.shape
    step = rows_per_block(C)
    out = torch.empty_like(residual, memory_format=torch.contiguous_format)

    def body(scratch: blocks.Scratch) -> Callable[[Block], None]:
        bufs = _Buffers(scratch, min(step, L), C)

        def run(block: Block) -> None:
            b, _, l0, l1, rows = block
            acc = _gated_sum_exact(residual[b, l0:l1], x[b, l0:l1], rows["gate"], bufs)
            out[b, l0:l1].copy_(acc)

        return run

    workers.run_items(list(walk_rows(B, L, step, {"gate": gate})), body)
    return out


def _exact(
    residual: torch.Tensor | None,
    x: torch.Tensor,
    gate: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
    eps: float,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Exact mode of both norm ops; with ``residual`` None, the modulated norm of ``x`` alone."""
    B, L, C = x.shape
    step, piece = _plan(B, L, rows_per_block(C), 4 * C)
    out = torch.empty((B, L, C), dtype=out_dtype, device=x.device)
    new_res = None
    if residual is not None:
        new_res = torch.empty_like(residual, memory_format=torch.contiguous_format)
    mods = {"gate": gate, **_scale_operands(scale, L), "shift": shift}

    def body(scratch: blocks.Scratch) -> Callable[[Block], None]:
        bufs = _Buffers(scratch, min(step, L), C)

        def run(block: Block) -> None:
            b, _, l0, l1, rows = block
            xc = x[b, l0:l1]
            if residual is None or new_res is None:
                y_in = xc if xc.dtype == torch.float32 else bufs.get(0, l1 - l0).copy_(xc)
            else:
                y_in = _gated_sum_exact(residual[b, l0:l1], xc, rows["gate"], bufs)
                nr = new_res[b, l0:l1]
                nr.copy_(y_in)
                if nr.dtype != torch.float32:
                    y_in.copy_(nr)  # the norm reads the rounded residual, as eager after type_as
            _ln_mod_block_exact(y_in, weight, bias, eps, rows, out[b, l0:l1], bufs, piece)

        return run

    workers.run_items(list(walk_rows(B, L, step, mods)), body)
    return out, new_res


# --- fast: folded affine parameters, one LayerNorm call per block ------------------------


def _folded_params(
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    scale_row: torch.Tensor | None,
    shift_row: torch.Tensor | None,
    C: int,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """fp32 [C] w', b' with LN(x; w', b') == LN(x; w, b) * (1 + scale) + shift (None: absent)."""
    f32 = torch.float32
    w = None if weight is None else weight.to(f32)
    b = None if bias is None else bias.to(f32)
    if scale_row is not None:
        s1 = (1 + scale_row).to(f32)  # 1 + scale in scale's dtype, as eager rounds it
        w = s1 if w is None else w * s1
        b = None if b is None else b * s1
    if shift_row is not None:
        t = shift_row.to(f32)
        b = t if b is None else b + t
    # A scalar modulation leaves 0-d parameters: LayerNorm takes [C].
    return (None if w is None else w.expand(C)), (None if b is None else b.expand(C))


def _fast(
    residual: torch.Tensor | None,
    x: torch.Tensor,
    gate: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
    eps: float,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fast mode of both norm ops; with ``residual`` None, the modulated norm of ``x`` alone.

    The gated residual is the exact one (it is as fast as anything else here). The norm
    folds a per-sample/per-frame modulation into LayerNorm's affine parameters and runs
    ATen's mixed-dtype kernel on the low-precision rows; a per-token modulation (or an
    output dtype other than the norm input's) takes fp32 blocks and one ``addcmul``.
    """
    B, L, C = x.shape
    step = rows_per_block(C)
    dev = x.device
    norm_dtype = x.dtype if residual is None else residual.dtype
    token_rows = per_token(scale, L) or per_token(shift, L)
    fold = not token_rows and norm_dtype == out_dtype
    shared = all(m is None or m.dim() == 0 or m.shape[:2] == (1, 1) for m in (scale, shift))
    if residual is None and fold and shared:
        # One affine for every row: a single mixed-dtype LayerNorm over the whole tensor.
        s = scale if scale is None or scale.dim() == 0 else scale[0, 0]
        t = shift if shift is None or shift.dim() == 0 else shift[0, 0]
        w, bb = _folded_params(weight, bias, s, t, C)
        return F.layer_norm(x, (C,), w, bb, eps), None
    out = torch.empty((B, L, C), dtype=out_dtype, device=dev)
    new_res = None if residual is None else torch.empty((B, L, C), dtype=norm_dtype, device=dev)
    # A folded LayerNorm writes norm_dtype rows; the other one fp32 rows.
    row_bytes = C * (norm_dtype.itemsize if fold else 4)
    step, piece = _plan(B, L, step, row_bytes)
    params: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor | None]] = {}
    mods = {"gate": gate, "scale": scale, "shift": shift}

    def body(scratch: blocks.Scratch) -> Callable[[Block], None]:
        bufs = _Buffers(scratch, min(step, L), C)

        def run(block: Block) -> None:
            b, g, l0, l1, rows = block
            if residual is None or new_res is None:
                normed_in = x[b, l0:l1]
            else:
                acc = _gated_sum_exact(residual[b, l0:l1], x[b, l0:l1], rows["gate"], bufs)
                normed_in = new_res[b, l0:l1]
                normed_in.copy_(acc)
            s, t = rows["scale"], rows["shift"]
            if fold:
                key = (b, g)
                if key not in params:  # two workers may both fold it: the same values
                    params[key] = _folded_params(weight, bias, s, t, C)
                w, bb = params[key]
                blocks.layer_norm_into(out[b, l0:l1], normed_in, w, bb, eps, piece)
                return
            work = bufs.get(0, l1 - l0)
            # the rounded residual (or low-precision x) in fp32
            y_in = normed_in if normed_in.dtype == torch.float32 else work.copy_(normed_in)
            y = blocks.layer_norm_rows(y_in, weight, bias, eps, piece, work)
            if s is not None and s.dtype == torch.float32:
                y.addcmul_(y, s)  # y * (1 + s) as y + y * s: one pass, no temporary for 1 + s
            elif s is not None:
                y.mul_(_one_plus(s, bufs))  # eager rounds 1 + s to a low-precision scale's dtype
            if t is not None:
                y.add_(_f32_rows(t, bufs))
            out[b, l0:l1].copy_(y)

        return run

    workers.run_items(list(walk_rows(B, L, step, mods)), body)
    return out, new_res


# --- the custom ops ---------------------------------------------------------------------


@opaque_op("ditops::cpu_layer_norm_scale_shift")
def layer_norm_scale_shift(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
    eps: float,
    out_dtype: torch.dtype,
    exact: bool,
) -> torch.Tensor:
    """``(LN_fp32(x) * (1 + scale) + shift).to(out_dtype)`` for ``x`` [B, L, C] on CPU.

    ``exact=True`` is bitwise equal to the eager expression; ``exact=False`` is within the
    fast tolerance. weight/bias are fp32 [C] or None; scale/shift as in the module docstring.
    """
    if x.numel() == 0:
        return torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if exact or out_dtype == torch.float32:
        # An fp32 output shows every reordering of fp32 math: fast gives the exact bits.
        return _exact(None, x, None, weight, bias, scale, shift, eps, out_dtype)[0]
    return _fast(None, x, None, weight, bias, scale, shift, eps, out_dtype)[0]


@layer_norm_scale_shift.register_fake
def _(x, weight, bias, scale, shift, eps, out_dtype, exact):
    return torch.empty(x.shape, dtype=out_dtype, device=x.device)


@opaque_op("ditops::cpu_gated_residual")
def gated_residual(
    residual: torch.Tensor, x: torch.Tensor, gate: torch.Tensor | None, exact: bool
) -> torch.Tensor:
    """``(residual.float() + x * gate).to(residual.dtype)`` for [B, L, C] tensors on CPU.

    ``gate`` None means no gating (``gate == 1``).
    """
    if residual.numel() == 0:
        return torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)
    # The exact kernel is as fast as a fused one here: fast mode uses it too.
    return _gated_residual_exact(residual, x, gate)


@gated_residual.register_fake
def _(residual, x, gate, exact):
    return torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)


@opaque_op("ditops::cpu_scale_residual_layer_norm_scale_shift")
def scale_residual_layer_norm_scale_shift(
    residual: torch.Tensor,
    x: torch.Tensor,
    gate: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
    eps: float,
    out_dtype: torch.dtype,
    exact: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated residual and the modulated norm of its (rounded) result, in one pass.

    Returns ``(modulated, new_residual)`` with ``new_residual = (residual.float() + x *
    gate).to(residual.dtype)`` and ``modulated = (LN_fp32(new_residual) * (1 + scale) +
    shift).to(out_dtype)``.
    """
    if residual.numel() == 0:
        empty = torch.empty(residual.shape, dtype=out_dtype, device=residual.device)
        return empty, torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)
    kernel = _exact if exact or out_dtype == torch.float32 else _fast
    out, new_res = kernel(residual, x, gate, weight, bias, scale, shift, eps, out_dtype)
    assert new_res is not None
    return out, new_res


@scale_residual_layer_norm_scale_shift.register_fake
def _(residual, x, gate, weight, bias, scale, shift, eps, out_dtype, exact):
    return (
        torch.empty(residual.shape, dtype=out_dtype, device=residual.device),
        torch.empty(residual.shape, dtype=residual.dtype, device=residual.device),
    )
