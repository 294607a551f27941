"""The precision contract as assertions, shared by every op's tests.

``exact``: bitwise equal (NaN where the reference has NaN). ``fast``: at most ``max_ulp``
units in the last place of the output dtype from the reference, on at most
``max_fraction`` of the elements; an element whose absolute difference is at most ``atol``
passes the ulp bound (a cancellation allowance: where ``w * n + b`` nearly cancels, a
result near 0 changes by many ulps when fp32 rounding moves by 1e-7). The fraction is
a rate, so on small tensors a few elements of slack (``slack``) keep one unlucky rounding
from failing a test; tests that check the rate itself use large tensors.
"""

from __future__ import annotations

import torch

_INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def max_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest deviation from ``ref`` relative to its largest magnitude (in fp32)."""
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max())


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Number of representable values between a and b, elementwise (same dtype)."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    view = _INT_VIEW[a.dtype]
    ia = a.contiguous().view(view).to(torch.int64)
    ib = b.contiguous().view(view).to(torch.int64)
    bits = 16 if view is torch.int16 else 32
    sign = 1 << (bits - 1)
    # Map the sign-magnitude encoding onto a monotonic integer line.
    ia = torch.where(ia < 0, -(ia & (sign - 1)), ia)
    ib = torch.where(ib < 0, -(ib & (sign - 1)), ib)
    return (ia - ib).abs()


def assert_exact(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype, (out.dtype, ref.dtype)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.equal(out.isnan(), ref.isnan()), "NaN positions differ"
    same = (out == ref) | (out.isnan() & ref.isnan())
    n_bad = int((~same).sum())
    assert n_bad == 0, (
        f"{n_bad} of {out.numel()} elements differ; max abs diff {(out - ref).abs().max()}"
    )


def assert_fast(
    out: torch.Tensor,
    ref: torch.Tensor,
    max_ulp: int = 1,
    max_fraction: float = 1e-3,
    slack: int = 3,
    atol: float = 0.0,
) -> None:
    assert out.dtype == ref.dtype, (out.dtype, ref.dtype)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.equal(out.isnan(), ref.isnan()), "NaN positions differ"
    finite = ~ref.isnan()
    dist = ulp_distance(torch.where(finite, out, 0), torch.where(finite, ref, 0))
    if atol > 0:
        close = (out.float() - ref.float()).abs() <= atol
        dist = torch.where(close & (dist > 1), torch.ones_like(dist), dist)
    worst = int(dist.max()) if dist.numel() else 0
    assert worst <= max_ulp, f"{worst} ulp apart (allowed {max_ulp})"
    n_diff = int((dist > 0).sum())
    allowed = max_fraction * dist.numel() + slack
    assert n_diff <= allowed, (
        f"{n_diff} of {dist.numel()} elements differ (allowed {max_fraction:.0e} of them + {slack})"
    )


def pair_magnitude(t: torch.Tensor, layout: str) -> torch.Tensor:
    """fp32 ``hypot(t1, t2)`` of the rotated pair each element of ``t`` ([..., D]) is in;
    pairs are ``(t[2i], t[2i+1])`` (``"interleaved"``) or ``(t[i], t[i + D/2])``."""
    t = t.float()
    if layout == "interleaved":
        return torch.hypot(t[..., 0::2], t[..., 1::2]).repeat_interleave(2, -1)
    h = t.shape[-1] // 2
    m = torch.hypot(t[..., :h], t[..., h:])
    return torch.cat([m, m], -1)


def assert_fast_pairs(
    out: torch.Tensor,
    ref: torch.Tensor,
    layout: str,
    max_ulp: float = 2,
    max_fraction: float = 1e-3,
    slack: int = 3,
) -> None:
    """The contract of rotated outputs (``qk_norm_rope`` fast): every element within
    ``max_ulp`` ulps of the output dtype taken at its pair's magnitude (a rotation near an
    axis makes one member tiny, and eager's earlier rounding of the pair's inputs shows
    there as many ulps of that member but not of the pair), and at most ``max_fraction``
    of the elements beyond 1 such ulp. NaN and infinities where the reference has them."""
    assert out.dtype == ref.dtype, (out.dtype, ref.dtype)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.equal(out.isnan(), ref.isnan()), "NaN positions differ"
    inf = ref.isinf()
    assert torch.equal(out[inf], ref[inf]), "infinities differ"
    mag = pair_magnitude(ref, layout).to(ref.dtype)
    ulp = (torch.nextafter(mag, torch.full_like(mag, float("inf"))) - mag).float()
    check = torch.isfinite(ref) & torch.isfinite(mag)
    err = torch.where(check, (out.float() - ref.float()).abs() / ulp, 0)
    worst = float(err.max()) if err.numel() else 0.0
    assert worst <= max_ulp, f"{worst:.2f} ulps of the pair's magnitude apart (allowed {max_ulp})"
    n_over = int((err > 1).sum())
    allowed = max_fraction * err.numel() + slack
    assert n_over <= allowed, (
        f"{n_over} of {err.numel()} elements beyond 1 ulp of their pair's magnitude "
        f"(allowed {max_fraction:.0e} of them + {slack})"
    )
