"""sglang's ``RotaryEmbedding`` (``CustomOp``) through :data:`ditops.rotary_embedding`.

sglang's ``forward_native`` picks its tables three ways, and rotates each with one of
two expressions; ditops' forward keeps the picking (it is bookkeeping) and puts the
rotation on ditops' op:

* the precomputed cache (``use_precomputed_cache``: the text encoders' ``get_rope``):
  ``cache[positions (+ offsets)]`` split into cos and sin, q/k ``[T, H * D]`` or
  ``[B, S, H * D]`` viewed per token and head;
* ``cos``/``sin`` given (DiT style, q/k ``[B, S, H, D]``);
* ``complex_freqs`` ``[S, 1, D / 2]``: its real and imaginary parts are cos and sin.

NeoX style (halves) rotates ``(x1 * cos - x2 * sin, x2 * cos + x1 * sin)`` in fp32,
rounded once: ditops' ``layout="halves"``. GPT-J style (interleaved pairs) is sglang's
complex multiply in fp32, rounded once: ditops' ``layout="interleaved"``. Both bitwise
sglang's (``tests/sglang/test_rotary.py``). A partial rotation (``rotary_dim <
head_size``) rotates the leading ``rotary_dim`` and appends the rest, as sglang does.
Tables come as fp32 (a cache kept in fp16/bf16 widens exactly, and sglang computes in
fp32 from it too). Anything else (sglang's flashinfer ``cos_sin_cache`` path, extra
arguments) runs sglang's ``forward_native``; a call ditops' op refuses does too, with
one warning naming why.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ditops.ops.qk_norm_rope import rotary_embedding

log = logging.getLogger(__name__)
_warned: set[str] = set()


def _rotate(
    module: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fp32: bool
) -> torch.Tensor:
    """Rotate ``x``'s leading ``rotary_dim`` (``[T, H, D]`` or ``[B, S, H, D]``) with
    tables ``[S or T, rotary_dim / 2]`` in fp32 (``fp32``) or x's dtype; the rest passes."""
    d = module.rotary_dim
    flat = x.dim() == 3
    part = x[..., :d].unsqueeze(0) if flat else x[..., :d]
    layout = "halves" if module.is_neox_style else "interleaved"
    dtype = torch.float32 if fp32 else x.dtype
    out = rotary_embedding(part, cos.to(dtype), sin.to(dtype), layout)
    out = out.squeeze(0) if flat else out
    return out if d == x.shape[-1] else torch.cat((out, x[..., d:]), dim=-1)


def _tables(module: Any, positions, offsets, cos, sin, complex_freqs, query, key):
    """``(cos, sin, view, fp32)`` as sglang's ``forward_native`` picks them (``view``: how
    q/k are seen per token and head; ``fp32``: sglang rotates in fp32, else in x's dtype),
    or None where ditops does not serve the call."""
    neox, full = module.is_neox_style, module.rotary_dim == module.head_size
    if module.use_precomputed_cache:
        if positions is None or complex_freqs is not None:
            return None
        if offsets is not None:
            positions = positions + offsets
        positions = positions.flatten()
        cos, sin = module.cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
        picked = cos, sin, (positions.shape[0], -1, module.head_size), neox
    elif query.dim() != 4 or key.dim() != 4:
        return None
    elif cos is not None and sin is not None:
        # GPT-J pairs over the whole head with one angle per position: sglang's complex
        # multiply in fp32; otherwise its real expression (fp32 for NeoX, x's dtype else).
        complex_ = not neox and full and complex_freqs is None and cos.shape[0] == query.shape[1]
        picked = cos, sin, None, neox or complex_
    elif complex_freqs is not None and complex_freqs.dim() == 3 and not neox and full:
        picked = complex_freqs.real.squeeze(-2), complex_freqs.imag.squeeze(-2), None, True
    else:
        return None
    # One angle per pair (sglang also takes per-element GPT-J tables, read differently).
    return picked if picked[0].shape[-1] * 2 == module.rotary_dim else None


def rotary_embedding_forward(
    module: Any,
    positions: torch.Tensor | None = None,
    query: torch.Tensor | None = None,
    key: torch.Tensor | None = None,
    position_offset: int = 0,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    complex_freqs: torch.Tensor | None = None,
    cos_sin_cache: torch.Tensor | None = None,
    offsets: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``RotaryEmbedding.forward``: sglang's choice of tables, ditops' rotation."""
    args = dict(
        positions=positions, query=query, key=key, position_offset=position_offset, cos=cos,
        sin=sin, complex_freqs=complex_freqs, cos_sin_cache=cos_sin_cache, offsets=offsets,
    )  # fmt: skip
    picked = None
    if not kwargs and cos_sin_cache is None and query is not None and key is not None:
        picked = _tables(module, positions, offsets, cos, sin, complex_freqs, query, key)
    if picked is None:
        return module.forward_native(**args, **kwargs)
    c, s, view, fp32 = picked
    try:
        if view is None:
            return _rotate(module, query, c, s, fp32), _rotate(module, key, c, s, fp32)
        q = _rotate(module, query.reshape(view), c, s, fp32).reshape(query.shape)
        return q, _rotate(module, key.reshape(view), c, s, fp32).reshape(key.shape)
    except (TypeError, ValueError) as error:
        if "RotaryEmbedding" not in _warned:
            _warned.add("RotaryEmbedding")
            log.warning("ditops: RotaryEmbedding runs sglang's own expression: %s", error)
        return module.forward_native(**args)
