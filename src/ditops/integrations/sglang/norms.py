"""ditops' forwards for sglang's norm modules, in sglang's arithmetic.

Bound by ditops' plugin (:mod:`.plugin`, :mod:`.forwards`) to the exact classes of
``sglang.multimodal_gen.runtime.layers.layernorm``; each forward is called as
``fn(module, *args)`` and calls a ditops op, which picks its path per call from the
tensors' device (CPU kernel, Triton, NPU, or the plain-torch meaning), with ditops'
fallback and ``DITOPS_STRICT`` / ``DITOPS_PRECISION``.

The meaning is sglang's own native expression (``forward_native``, with
``fuse_scale_shift_kernel`` read as its plain-torch fallback), not diffusers':

* ``FP32LayerNorm``: ``F.layer_norm(x.float(), ..., w.float(), b.float()).to(x.dtype)``:
  :data:`ditops.fp32_layer_norm`, the same expression.
* ``RMSNorm``: fp32 ``x * rsqrt(mean(x^2) + eps) * w`` rounded once; with ``residual``
  the fp32 sum ``x + residual`` is normalised and returned rounded. :data:`ditops.rms_norm`
  (torch convention), of the fp32 sum when there is a residual. ``var_hidden_size`` runs
  sglang's own forward.
* ``LayerNormScaleShift``: ``(LN(x).to(x.dtype) * (1 + scale) + shift).to(x.dtype)``:
  :data:`ditops.layer_norm_scale_shift`.
* ``ScaleResidualLayerNormScaleShift``: ``h = residual + x * gate`` in torch's promotion
  (a bf16 stream with an fp32 gate gives an fp32 ``h``: sglang normalises that sum and
  returns it in fp32, where diffusers rounds it first), then ``LN(h).to(h.dtype) *
  (1 + scale) + shift`` in the promoted dtype; returns ``(modulated, h)``. When ``h``
  keeps the residual's dtype, :data:`ditops.scale_residual_layer_norm_scale_shift` (one
  pass); when promotion widens it, ``h`` is sglang's own expression and its norm
  :data:`ditops.layer_norm_scale_shift` of ``h``.

sglang's modulation conventions are translated: ``torch.zeros((1,))`` ("no shift/scale")
and any other one-element tensor become a ``[C]`` view (a broadcast keeps torch's
promotion of a dimensioned tensor, where a 0-d one would promote differently), ``[B, C]``
becomes ``[B, 1, C]``; ``[C]``, ``[B, 1, C]``, ``[B, L, C]`` and per-frame ``[B, F, 1,
C]`` pass as they are; ``gate=1`` (the int) adds ``x`` unscaled. A call ditops' ops refuse
runs sglang's expression in plain torch, with one warning naming why. Where the stream
is wider than a modulation (sglang's bf16 zeros against an fp32 ``h``) the modulation is
widened as eager widens it (:func:`_widened_scale`).

Precision against that meaning: fp32 is bitwise (``DITOPS_PRECISION=exact`` everywhere;
``fast`` on the CPU path too). bf16/fp16: ``FP32LayerNorm`` and ``RMSNorm`` within ditops'
fast contract (1 ulp; bitwise in ``exact``); the two modulated norms differ from sglang
by one rounding: sglang rounds ``LN`` to the stream's dtype before modulating, ditops
keeps it in fp32 and rounds once, so an element is within 1 ulp of the output dtype of
``|LN(h) * (1 + scale)| + |shift|`` (plus ditops' fast contract, 1 ulp), ``h`` itself
bitwise. ``tests/sglang/test_norms.py`` measures both.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ditops.ops.layer_norm import fp32_layer_norm
from ditops.ops.modulation_fp32 import layer_norm_scale_shift, scale_residual_layer_norm_scale_shift
from ditops.ops.qk_norm_rope import rms_norm

log = logging.getLogger(__name__)
_warned: set[str] = set()

Modulation = Any  # a tensor or a Python number, in sglang's shapes


def _modulation(m: Modulation, x: torch.Tensor) -> Modulation:
    """sglang's modulation shapes -> ditops' (see the module docstring)."""
    if not isinstance(m, torch.Tensor) or m.dim() == 0:
        return m
    if m.numel() == 1:
        return m.reshape(1).expand(x.shape[-1])
    if m.dim() == 2:
        return m.unsqueeze(1)
    return m


def _promoted(dtype: torch.dtype, *mods: Modulation) -> torch.dtype:
    """The dtype of ``tensor_of(dtype) * (1 + scale) + shift`` in eager torch."""
    probe = torch.empty((1,), dtype=dtype, device="meta")
    for m in mods:
        dtype = torch.result_type(probe, m if not isinstance(m, torch.Tensor) else m.to("meta"))
        probe = torch.empty((1,), dtype=dtype, device="meta")
    return dtype


def _narrower(m: Modulation, dtype: torch.dtype) -> bool:
    return isinstance(m, torch.Tensor) and torch.promote_types(m.dtype, dtype) != m.dtype


def _widened_shift(shift: Modulation, dtype: torch.dtype) -> Modulation:
    """A shift narrower than the normalised stream, widened as eager's ``+`` widens it."""
    return shift.to(dtype) if _narrower(shift, dtype) else shift


def _widened_scale(scale: Modulation, dtype: torch.dtype) -> Modulation:
    """A scale narrower than the stream, as ``s'`` with ``1 + s' == (1 + scale).to(dtype)``:
    eager computes ``1 + scale`` in the scale's dtype, then widens. ``(1 + scale) - 1`` in
    fp32 undoes the ``1 +`` exactly for every bf16 and fp16 value but a bf16 ``1 + scale``
    of exactly ``-2**24`` (checked over all of them)."""
    return (1 + scale).to(dtype) - 1 if _narrower(scale, dtype) else scale


def gated_sum(residual: torch.Tensor, x: torch.Tensor, gate: Any) -> torch.Tensor:
    """sglang's ``residual + x * gate`` (per-frame gates ``[B, F, 1, C]`` included)."""
    if isinstance(gate, bool) or not isinstance(gate, (int, torch.Tensor)):
        raise ValueError(f"Gate type {type(gate)} not supported: sglang takes the int 1 or tensors")
    if not isinstance(gate, torch.Tensor):
        if gate != 1:
            raise ValueError(f"gate={gate}: sglang's chain takes the int gate 1 only")
        return residual + x
    if gate.dim() == 4:
        frames = gate.shape[1]
        grouped = x.unflatten(1, (frames, x.shape[1] // frames))
        return residual + (grouped * gate).flatten(1, 2)
    return residual + x * gate


def _sglang_modulated_norm(norm: Any, h: torch.Tensor, shift: Modulation, scale: Modulation):
    """``fuse_scale_shift_kernel``'s plain-torch meaning over sglang's own norm of ``h``."""
    from sglang.kernels.ops.diffusion.common.fallback_torch import fuse_scale_shift_kernel_native

    return fuse_scale_shift_kernel_native(norm(h), scale, shift)


def _refused(op: str, error: Exception) -> None:
    if op not in _warned:
        _warned.add(op)
        log.warning("ditops: %s runs sglang's own expression: ditops refused (%s)", op, error)


def fp32_layer_norm_forward(module: Any, inputs: torch.Tensor) -> torch.Tensor:
    """``FP32LayerNorm.forward`` through :data:`ditops.fp32_layer_norm`."""
    shape = tuple(module.normalized_shape)
    return fp32_layer_norm(inputs, shape, module.weight, module.bias, module.eps)


def rms_norm_forward(
    module: Any, x: torch.Tensor, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``RMSNorm.forward`` through :data:`ditops.rms_norm` (torch convention)."""
    if module.variance_size_override is not None or x.shape[-1] != module.hidden_size:
        return module.forward_native(x, residual)  # sglang's own (it also raises on a bad size)
    eps = module.variance_epsilon
    if residual is None:
        return rms_norm(x, module.weight, eps)
    total = x.float() + residual.float()
    return rms_norm(total, module.weight, eps).to(x.dtype), total.to(x.dtype)


def layer_norm_scale_shift_forward(
    module: Any, x: torch.Tensor, shift: Modulation, scale: Modulation
) -> torch.Tensor:
    """``LayerNormScaleShift.forward`` through :data:`ditops.layer_norm_scale_shift`."""
    norm = module.norm
    try:
        s, t = _modulation(scale, x), _modulation(shift, x)
        return layer_norm_scale_shift(x, norm.weight, norm.bias, s, t, norm.eps, out_dtype=x.dtype)
    except (TypeError, ValueError) as error:
        _refused("LayerNormScaleShift", error)
        return _sglang_modulated_norm(norm, x, shift, scale).to(x.dtype)


def scale_residual_layer_norm_scale_shift_forward(
    module: Any,
    residual: torch.Tensor,
    x: torch.Tensor,
    gate: Any,
    shift: Modulation,
    scale: Modulation,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``ScaleResidualLayerNormScaleShift.forward`` in sglang's arithmetic (see above)."""
    norm = module.norm
    if not isinstance(gate, torch.Tensor):
        gated_sum(residual[:0], x[:0], gate)  # sglang's refusals of a non-tensor gate
        summed = torch.promote_types(residual.dtype, x.dtype)
    else:
        product = torch.result_type(x.to("meta"), gate.to("meta"))
        summed = torch.promote_types(residual.dtype, product)
    try:
        s, t = _modulation(scale, x), _modulation(shift, x)
        out_dtype = _promoted(summed, s, t)
        if summed == residual.dtype:
            g = _modulation(gate, x)
            return scale_residual_layer_norm_scale_shift(
                residual, x, g, norm.weight, norm.bias, s, t, norm.eps, out_dtype=out_dtype
            )
        h = gated_sum(residual, x, gate)
        s, t = _widened_scale(s, h.dtype), _widened_shift(t, h.dtype)
        out = layer_norm_scale_shift(h, norm.weight, norm.bias, s, t, norm.eps, out_dtype=out_dtype)
        return out, h
    except (TypeError, ValueError) as error:
        _refused("ScaleResidualLayerNormScaleShift", error)
        h = gated_sum(residual, x, gate)
        return _sglang_modulated_norm(norm, h, shift, scale), h
