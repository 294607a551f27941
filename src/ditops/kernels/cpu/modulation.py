"""DiT modulation on CPU: LayerNorm with scale/shift, the gated residual, and both fused.

Inputs are already validated and normalised (see :mod:`ditops.kernels.modulation_shapes`):
activations ``[B, L, C]``, LayerNorm weight/bias fp32 ``[C]`` or None, each modulation
None, a 0-d tensor (a scalar, promoted as eager PyTorch promotes scalars) or a
``[Bm, G, C]`` view, token ``l`` using row ``l // (L // G)``.

Memory model (bf16 [8192, 5120], fp32 [B, 1, C] modulation): the eager chain
``(LN(x.float()) * (1 + scale) + shift).to(bf16)`` makes five passes over the whole
tensor, most of them in fp32. Both precisions here walk the rows in blocks whose fp32
temporaries stay in L2, so DRAM sees one read of each input and one write of each
output:

* ``exact`` runs the very eager ops, block by block. Every one of them is elementwise
  or normalises each row on its own, so the bits are those of the eager expression.
* ``fast`` folds a per-sample or per-frame modulation into LayerNorm's affine
  parameters, ``w' = w * (1 + scale)``, ``b' = b * (1 + scale) + shift`` (fp32, one row
  of C each), and lets ATen's mixed-dtype LayerNorm (low-precision in and out, fp32
  inside, one pass) do everything. Per-token modulation uses fused ``addcmul`` on the
  block. Rounded once to the output dtype; the fp32 intermediates are ordered
  differently from eager, so a few elements in 1e5 differ by 1 ulp (more where
  ``shift`` nearly cancels the normalised value: see the layer's tolerance).

Each kernel is a ``torch.library`` custom op, so ``torch.compile`` calls it as one
opaque op instead of unrolling the block loop.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

#: fp32 bytes per block of rows: the block's few fp32 temporaries stay in a 2 MiB L2.
_BLOCK_BYTES = 512 * 1024


def _rows_per_block(C: int) -> int:
    return max(1, _BLOCK_BYTES // max(1, 4 * C))


def _groups(*mods: torch.Tensor | None) -> int:
    """The common row count G of the 3-D modulations (1 when none is per frame/token)."""
    g = 1
    for m in mods:
        if m is not None and m.dim() == 3 and m.shape[1] > 1:
            g = m.shape[1]
    return g


def _blocks(B: int, L: int, G: int, step: int) -> Iterator[tuple[int, int, int, int]]:
    """(b, l0, l1, g): rows l0:l1 of sample b, all in group g (g is unused when G is 1 or L)."""
    seg = L if G in (1, L) else L // G
    for b in range(B):
        for s0 in range(0, L, max(seg, 1)):
            g = s0 // seg if seg else 0
            for l0 in range(s0, min(s0 + seg, L), step):
                yield b, l0, min(l0 + step, s0 + seg, L), g


def _rows(m: torch.Tensor | None, b: int, l0: int, l1: int, g: int, L: int) -> torch.Tensor | None:
    """The part of a modulation that rows l0:l1 of sample b use: 0-d, [C] or [l1 - l0, C]."""
    if m is None or m.dim() == 0:
        return m
    bm = b if m.shape[0] > 1 else 0
    G = m.shape[1]
    if G == 1:
        return m[bm, 0]
    if G == L:
        return m[bm, l0:l1]
    return m[bm, g]


def _per_token(m: torch.Tensor | None, L: int) -> bool:
    return m is not None and m.dim() == 3 and m.shape[1] == L and L > 1


# --- exact: the eager ops, block by block -----------------------------------------------


class _Buffers:
    """Two fp32 blocks reused across the row loop (no allocation per block)."""

    def __init__(self, rows: int, C: int, device: torch.device) -> None:
        self.a = torch.empty((rows, C), dtype=torch.float32, device=device)
        self.b = torch.empty((rows, C), dtype=torch.float32, device=device)

    def take(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a[:n], self.b[:n]


def _one_plus(scale: torch.Tensor | None, L: int) -> torch.Tensor | None:
    """``1 + scale`` for the whole modulation, as eager computes it (in scale's dtype).

    Per-token scales are left to the blocks (the sum would be a full extra pass)."""
    if scale is None or _per_token(scale, L):
        return None
    return 1 + scale


def _scale_rows(
    one_plus: torch.Tensor | None,
    scale: torch.Tensor | None,
    b: int,
    l0: int,
    l1: int,
    g: int,
    L: int,
) -> torch.Tensor | None:
    if one_plus is not None:
        return _rows(one_plus, b, l0, l1, g, L)
    if scale is not None:
        return 1 + _rows(scale, b, l0, l1, g, L)
    return None


def _gated_sum_exact(
    rc: torch.Tensor, xc: torch.Tensor, g: torch.Tensor | None, acc: torch.Tensor, tmp: torch.Tensor
) -> torch.Tensor:
    """acc = residual.float() + x * gate for one block, with the bits of the eager expression.

    When ``x * gate`` is computed in fp32 (an fp32 gate or fp32 x) it is done in place in
    ``acc``; a low-precision product (bf16 x times a bf16 or scalar gate) is rounded to
    its dtype first, as eager does. IEEE addition commutes, so adding the residual to
    the product gives the same bits as the eager order.
    """
    if g is None:
        acc.copy_(xc)  # x * 1 == x: nothing to round
    elif torch.result_type(xc, g) == torch.float32:
        acc.copy_(xc)
        acc.mul_(g)
    else:
        acc.copy_(xc * g)
    if rc.dtype == torch.float32:
        acc.add_(rc)
    else:
        tmp.copy_(rc)  # a same-dtype add: a mixed one makes its own fp32 temporary
        acc.add_(tmp)
    return acc


def _ln_mod_block_exact(
    y_in: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    s1: torch.Tensor | None,
    t: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    """out = (LN(y_in) * s1 + t).to(out.dtype) for one fp32 block, as eager computes it."""
    y = F.layer_norm(y_in, (y_in.shape[-1],), weight, bias, eps)
    if s1 is not None:
        y.mul_(s1)  # fp32 result either way: in place gives the bits of y * s1
    if t is not None:
        y.add_(t)
    out.copy_(y)  # rounds to nearest even, as .to() does


def _layer_norm_scale_shift_exact(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
    eps: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    B, L, C = x.shape
    step = _rows_per_block(C)
    out = torch.empty((B, L, C), dtype=out_dtype, device=x.device)
    bufs = _Buffers(step, C, x.device)
    one_plus = _one_plus(scale, L)
    for b, l0, l1, g in _blocks(B, L, _groups(scale, shift), step):
        xc = x[b, l0:l1]
        y_in = xc if xc.dtype == torch.float32 else bufs.take(l1 - l0)[0].copy_(xc)
        s1 = _scale_rows(one_plus, scale, b, l0, l1, g, L)
        _ln_mod_block_exact(
            y_in, weight, bias, eps, s1, _rows(shift, b, l0, l1, g, L), out[b, l0:l1]
        )
    return out


def _gated_residual_exact(
    residual: torch.Tensor, x: torch.Tensor, gate: torch.Tensor | None
) -> torch.Tensor:
    B, L, C = residual.shape
    step = _rows_per_block(C)
    out = torch.empty_like(residual, memory_format=torch.contiguous_format)
    bufs = _Buffers(step, C, residual.device)
    for b, l0, l1, g in _blocks(B, L, _groups(gate), step):
        acc, tmp = bufs.take(l1 - l0)
        _gated_sum_exact(residual[b, l0:l1], x[b, l0:l1], _rows(gate, b, l0, l1, g, L), acc, tmp)
        out[b, l0:l1].copy_(acc)
    return out


def _fused_exact(
    residual: torch.Tensor,
    x: torch.Tensor,
    gate: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
    eps: float,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    B, L, C = residual.shape
    step = _rows_per_block(C)
    out = torch.empty((B, L, C), dtype=out_dtype, device=x.device)
    new_res = torch.empty_like(residual, memory_format=torch.contiguous_format)
    bufs = _Buffers(step, C, x.device)
    one_plus = _one_plus(scale, L)
    for b, l0, l1, g in _blocks(B, L, _groups(gate, scale, shift), step):
        acc, tmp = bufs.take(l1 - l0)
        _gated_sum_exact(residual[b, l0:l1], x[b, l0:l1], _rows(gate, b, l0, l1, g, L), acc, tmp)
        nr = new_res[b, l0:l1]
        nr.copy_(acc)
        if nr.dtype != torch.float32:
            acc.copy_(nr)  # the norm reads the rounded residual, as eager does after type_as
        s1 = _scale_rows(one_plus, scale, b, l0, l1, g, L)
        _ln_mod_block_exact(
            acc, weight, bias, eps, s1, _rows(shift, b, l0, l1, g, L), out[b, l0:l1]
        )
    return out, new_res


# --- fast: folded affine parameters, one LayerNorm call per block ------------------------


def _folded_params(
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    scale_row: torch.Tensor | None,
    shift_row: torch.Tensor | None,
    C: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [C] w', b' with LN(x; w', b') == LN(x; w, b) * (1 + scale) + shift."""
    f32 = torch.float32
    w = torch.ones(C, dtype=f32, device=device) if weight is None else weight.to(f32)
    b = torch.zeros(C, dtype=f32, device=device) if bias is None else bias.to(f32)
    if scale_row is not None:
        s1 = (1 + scale_row).to(f32)  # 1 + scale in scale's dtype, as eager rounds it
        w = w * s1
        b = b * s1
    if shift_row is not None:
        b = b + shift_row.to(f32)
    return w, b


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
    step = _rows_per_block(C)
    dev = x.device
    norm_dtype = x.dtype if residual is None else residual.dtype
    per_token = _per_token(scale, L) or _per_token(shift, L)
    fold = not per_token and norm_dtype == out_dtype
    G = _groups(gate, scale, shift)
    batched = any(m is not None and m.dim() == 3 and m.shape[0] > 1 for m in (scale, shift))
    if residual is None and fold and G == 1 and not batched:
        # One affine for every row: a single mixed-dtype LayerNorm over the whole tensor.
        w, bb = _folded_params(
            weight, bias, _rows(scale, 0, 0, 1, 0, L), _rows(shift, 0, 0, 1, 0, L), C, dev
        )
        return F.layer_norm(x, (C,), w, bb, eps), None
    out = torch.empty((B, L, C), dtype=out_dtype, device=dev)
    new_res = None if residual is None else torch.empty((B, L, C), dtype=norm_dtype, device=dev)
    bufs = _Buffers(step, C, dev)
    params: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    for b, l0, l1, g in _blocks(B, L, G, step):
        acc, tmp = bufs.take(l1 - l0)
        if residual is None or new_res is None:
            normed_in = x[b, l0:l1]
        else:
            _gated_sum_exact(
                residual[b, l0:l1], x[b, l0:l1], _rows(gate, b, l0, l1, g, L), acc, tmp
            )
            normed_in = new_res[b, l0:l1]
            normed_in.copy_(acc)
        s = _rows(scale, b, l0, l1, g, L)
        t = _rows(shift, b, l0, l1, g, L)
        if fold:
            key = (b, g)
            if key not in params:
                params[key] = _folded_params(weight, bias, s, t, C, dev)
            w, bb = params[key]
            out[b, l0:l1].copy_(F.layer_norm(normed_in, (C,), w, bb, eps))
            continue
        if normed_in.dtype == torch.float32:
            y_in = normed_in
        else:
            y_in = acc.copy_(normed_in)  # the rounded residual (or low-precision x) in fp32
        y = F.layer_norm(y_in, (C,), weight, bias, eps)
        if s is not None and s.dtype == torch.float32:
            y.addcmul_(y, s)  # y * (1 + s) as y + y * s: one pass, no temporary for 1 + s
        elif s is not None:
            y.mul_(1 + s)  # eager rounds 1 + s to a low-precision scale's dtype
        if t is not None:
            y.add_(t)
        out[b, l0:l1].copy_(y)
    return out, new_res


# --- the custom ops ---------------------------------------------------------------------


@torch.library.custom_op("ditops::cpu_layer_norm_scale_shift", mutates_args=())
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
        return _layer_norm_scale_shift_exact(x, weight, bias, scale, shift, eps, out_dtype)
    return _fast(None, x, None, weight, bias, scale, shift, eps, out_dtype)[0]


@layer_norm_scale_shift.register_fake
def _(x, weight, bias, scale, shift, eps, out_dtype, exact):
    return torch.empty(x.shape, dtype=out_dtype, device=x.device)


@torch.library.custom_op("ditops::cpu_gated_residual", mutates_args=())
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


@torch.library.custom_op("ditops::cpu_scale_residual_layer_norm_scale_shift", mutates_args=())
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
    if exact or out_dtype == torch.float32:
        return _fused_exact(residual, x, gate, weight, bias, scale, shift, eps, out_dtype)
    out, new_res = _fast(residual, x, gate, weight, bias, scale, shift, eps, out_dtype)
    assert new_res is not None
    return out, new_res


@scale_residual_layer_norm_scale_shift.register_fake
def _(residual, x, gate, weight, bias, scale, shift, eps, out_dtype, exact):
    return (
        torch.empty(residual.shape, dtype=out_dtype, device=residual.device),
        torch.empty(residual.shape, dtype=residual.dtype, device=residual.device),
    )
