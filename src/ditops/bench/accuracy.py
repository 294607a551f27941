"""How far a variant's output is from the reference's: what the benches report beside the
times (a faster variant that drifts is no win)."""

from __future__ import annotations

import math

import torch


def drift(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float]:
    """``(max abs, cosine, PSNR dB)`` of ``out`` against ``ref`` (PSNR's peak: max|ref|)."""
    # float64: an fp32 dot product over a million elements is off by ~1e-5 by itself.
    a, b = out.double().flatten(), ref.double().flatten()
    max_abs = float((a - b).abs().max())
    cosine = float(torch.nn.functional.cosine_similarity(a, b, dim=0))
    mse = float(((a - b) ** 2).mean())
    peak = float(b.abs().max()) or 1.0
    psnr = math.inf if mse == 0 else 10 * math.log10(peak * peak / mse)
    return max_abs, cosine, psnr


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``|out - ref| / |ref|`` (Frobenius norms, in fp32)."""
    return float((out.float() - ref.float()).norm() / ref.float().norm())
