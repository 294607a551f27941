"""Checks of q/k norms that several families' fused prologues rely on."""

from __future__ import annotations

from torch import nn


def rms_problems(attn: nn.Module, names: tuple[str, str], where: str) -> list[str]:
    """q's and k's norms: diffusers' RMSNorm over the head dim with a weight, no bias,
    one eps and weight dtype for both (the op takes one of each per call)."""
    from diffusers.models.normalization import RMSNorm

    q, k = (getattr(attn, n, None) for n in names)
    label = f"{where}.{names[0]}/{names[1]}"
    if type(q) is not RMSNorm or type(k) is not RMSNorm:
        return [f"{label} are not diffusers' RMSNorm"]
    problems = []
    head_dim = attn.inner_dim // attn.heads
    for norm in (q, k):
        if norm.weight is None or norm.bias is not None or tuple(norm.dim) != (head_dim,):
            problems.append(f"{label}: a weight, no bias and the head dim are expected")
    if q.eps != k.eps:
        problems.append(f"{label} have different eps ({q.eps}, {k.eps})")
    if q.weight is not None and k.weight is not None and q.weight.dtype != k.weight.dtype:
        problems.append(f"{label} have weights of different dtypes")
    return problems
