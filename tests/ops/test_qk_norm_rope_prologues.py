"""The fused q/k prologue gives, in exact mode on CPU, the bits Wan's and FLUX's attention
processors hand to attention (captured by replacing their ``dispatch_attention_fn``), in
fp32 and bf16, with the models' own rope tables.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ditops.ops.qk_norm_rope import qk_norm_rope
from tests.precision import assert_exact, assert_fast_pairs

diffusers = pytest.importorskip("diffusers")
from diffusers.models.transformers import transformer_flux as dflux  # noqa: E402
from diffusers.models.transformers import transformer_wan as dwan  # noqa: E402

from tests.ops.test_qk_norm_rope import BF16, EPS, FP32, _exact, _fast, _randomise  # noqa: E402


class _Capture:
    """Stands in for a diffusers module's ``dispatch_attention_fn``: keeps q and k."""

    def __init__(self) -> None:
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **_: Any):
        self.calls.append((query, key))
        return torch.zeros_like(query)


@pytest.fixture
def capture(monkeypatch: pytest.MonkeyPatch) -> _Capture:
    cap = _Capture()
    monkeypatch.setattr(dwan, "dispatch_attention_fn", cap)
    monkeypatch.setattr(dflux, "dispatch_attention_fn", cap)
    return cap


#: (attention dtype, rope dtype): fp32; bf16 as from_pretrained keeps it (rope in fp32,
#: _keep_in_fp32_modules); bf16 after model.to(bf16) (rope buffers cast too).
WAN_SETUPS = {"fp32": (FP32, FP32), "bf16": (BF16, FP32), "bf16-cast": (BF16, BF16)}


@pytest.mark.parametrize("setup", list(WAN_SETUPS))
@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_wan_processor_prologue(capture: _Capture, setup: str, precision: str) -> None:
    dtype, rope_dtype = WAN_SETUPS[setup]
    heads, head_dim, frames, h, w = 3, 16, 2, 4, 6
    torch.manual_seed(0)
    attn = dwan.WanAttention(
        heads * head_dim, heads, head_dim, eps=EPS, processor=dwan.WanAttnProcessor()
    )
    attn = _randomise(attn).to(dtype)
    rope = dwan.WanRotaryPosEmbed(head_dim, (1, 2, 2), max_seq_len=64).to(rope_dtype)
    rotary = rope(torch.zeros(1, 4, frames, 2 * h, 2 * w))
    x = torch.randn(2, frames * h * w, heads * head_dim).to(dtype)
    with torch.inference_mode():
        attn(x, None, None, rotary)
    ((want_q, want_k),) = capture.calls
    q = attn.to_q(x).unflatten(2, (heads, -1))
    k = attn.to_k(x).unflatten(2, (heads, -1))
    cos, sin = rotary[0][..., 0::2], rotary[1][..., 1::2]  # the entries Wan's processor reads
    run = _exact if precision == "exact" else _fast
    got_q, got_k = run(
        qk_norm_rope,
        q,
        k,
        attn.norm_q.weight,
        attn.norm_k.weight,
        cos,
        sin,
        attn.norm_q.eps,
        across_heads=True,
    )
    for got, want in ((got_q, want_q), (got_k, want_k)):
        if precision == "exact" or setup == "bf16-cast" or dtype == FP32:
            # fast with bf16 tables, and fp32 outputs, run eager's steps: exact too
            assert_exact(got, want)
        else:
            assert_fast_pairs(got, want, "interleaved", slack=5)


def _flux_rotary(text: int, image: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.cat([torch.zeros(text, 3), torch.randint(0, 16, (image, 3)).float()])
    return dflux.FluxPosEmbed(theta=10000, axes_dim=[4, 6, 6])(ids)


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_flux_single_stream_prologue_exact(capture: _Capture, dtype: torch.dtype) -> None:
    heads, head_dim, L = 2, 16, 11
    torch.manual_seed(0)
    attn = dflux.FluxAttention(heads * head_dim, heads, head_dim, eps=EPS, pre_only=True)
    attn = _randomise(attn).to(dtype)
    cos, sin = _flux_rotary(4, L - 4)
    x = torch.randn(2, L, heads * head_dim).to(dtype)
    with torch.inference_mode():
        attn(x, image_rotary_emb=(cos, sin))
    ((want_q, want_k),) = capture.calls
    q = attn.to_q(x).unflatten(-1, (-1, head_dim))
    k = attn.to_k(x).unflatten(-1, (-1, head_dim))
    got = _exact(qk_norm_rope, q, k, attn.norm_q.weight, attn.norm_k.weight, cos, sin, EPS)
    assert_exact(got[0], want_q)
    assert_exact(got[1], want_k)
    if dtype == BF16:
        fast = _fast(qk_norm_rope, q, k, attn.norm_q.weight, attn.norm_k.weight, cos, sin, EPS)
        assert_fast_pairs(fast[0], want_q, "interleaved", slack=5)


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_flux_double_stream_prologue_exact(capture: _Capture, dtype: torch.dtype) -> None:
    """Text and image tokens are normalised with their own weights, then concatenated and
    rotated together: one call per part, each on its slice of the tables."""
    heads, head_dim, text, image = 2, 16, 5, 9
    torch.manual_seed(0)
    attn = dflux.FluxAttention(
        heads * head_dim, heads, head_dim, eps=EPS, added_kv_proj_dim=24, context_pre_only=False
    )
    attn = _randomise(attn).to(dtype)
    cos, sin = _flux_rotary(text, image)
    x, ctx = torch.randn(1, image, heads * head_dim).to(dtype), torch.randn(1, text, 24).to(dtype)
    with torch.inference_mode():
        attn(x, ctx, image_rotary_emb=(cos, sin))
    ((want_q, want_k),) = capture.calls

    def split(t: torch.Tensor) -> torch.Tensor:
        return t.unflatten(-1, (-1, head_dim))

    txt = _exact(
        qk_norm_rope,
        split(attn.add_q_proj(ctx)),
        split(attn.add_k_proj(ctx)),
        attn.norm_added_q.weight,
        attn.norm_added_k.weight,
        cos[:text],
        sin[:text],
        EPS,
    )
    img = _exact(
        qk_norm_rope,
        split(attn.to_q(x)),
        split(attn.to_k(x)),
        attn.norm_q.weight,
        attn.norm_k.weight,
        cos[text:],
        sin[text:],
        EPS,
    )
    assert_exact(torch.cat([txt[0], img[0]], 1), want_q)
    assert_exact(torch.cat([txt[1], img[1]], 1), want_k)
