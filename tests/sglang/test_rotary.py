"""sglang's ``RotaryEmbedding`` on :data:`ditops.rotary_embedding`, against the op's own
``forward_native`` in every way sglang calls it: its precomputed cache with positions
(the text encoders' ``get_rope``, 3-D ``[T, H * D]`` q/k), the DiT-style 4-D q/k with
``cos``/``sin`` (GPT-J's interleaved pairs take sglang's complex multiply, NeoX's halves
its real expression), ``complex_freqs``, a partial rotation. Bitwise in each."""

from __future__ import annotations

import pytest
import torch
from sglang.multimodal_gen.runtime.layers.rotary_embedding.base import RotaryEmbedding

from ditops.integrations.sglang import rotary
from tests.sglang.helpers import pair

B, L, H, D = 2, 12, 3, 16


@pytest.fixture(autouse=True)
def _inference():
    rotary._warned.clear()
    with torch.no_grad():
        yield
    assert not rotary._warned, "fell back to sglang's expression"


def _rope(neox: bool, rotary_dim: int = D, cache: bool = True, dtype=torch.float32):
    kw = dict(is_neox_style=neox, dtype=dtype, use_precomputed_cache=cache)
    return pair(lambda: RotaryEmbedding(D, rotary_dim, 64, 10000, **kw))


def _same(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [D, D // 2])
def test_cached_positions_3d(dtype, neox, rotary_dim) -> None:
    mine, ref = _rope(neox, rotary_dim, dtype=dtype)
    assert mine._forward_method.func is rotary.rotary_embedding_forward
    positions = torch.randint(0, 60, (B, L))
    q, k = torch.randn(B, L, H * D).to(dtype), torch.randn(B, L, 2 * D).to(dtype)
    _same(mine(positions, q, k), ref.forward_native(positions, q, k))
    _same(mine(positions, q, k, offsets=3), ref.forward_native(positions, q, k, offsets=3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [D, D // 2])
def test_dit_style_cos_sin(dtype, neox, rotary_dim) -> None:
    """GPT-J over the whole head is sglang's complex multiply; a partial one its real
    expression in x's dtype; NeoX its fp32 expression."""
    mine, ref = _rope(neox, rotary_dim, cache=False)
    angles = torch.rand(L, rotary_dim // 2) * 6
    cos, sin = angles.cos(), angles.sin()
    q, k = torch.randn(B, L, H, D).to(dtype), torch.randn(B, L, H, D).to(dtype)
    want = ref.forward_native(query=q, key=k, cos=cos, sin=sin)
    _same(mine(query=q, key=k, cos=cos, sin=sin), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_complex_freqs(dtype) -> None:
    mine, ref = _rope(False, cache=False)
    freqs = torch.polar(torch.ones(L, 1, D // 2), torch.rand(L, 1, D // 2) * 6)
    q, k = torch.randn(B, L, H, D).to(dtype), torch.randn(B, L, H, D).to(dtype)
    got = mine(query=q, key=k, complex_freqs=freqs)
    _same(got, ref.forward_native(query=q, key=k, complex_freqs=freqs))


def test_runs_ditops_op(monkeypatch) -> None:
    seen = []
    real = rotary.rotary_embedding
    spy = lambda *a, **kw: seen.append(1) or real(*a, **kw)  # noqa: E731
    monkeypatch.setattr(rotary, "rotary_embedding", spy)
    mine, _ = _rope(True)
    mine(torch.arange(L), torch.randn(L, H * D), torch.randn(L, H * D))
    assert seen == [1, 1]  # q and k


def test_nan_propagates_as_in_sglang() -> None:
    mine, ref = _rope(True)
    q = torch.randn(L, H * D)
    q[3, 5] = float("nan")
    got, want = mine(torch.arange(L), q, q.clone()), ref.forward_native(torch.arange(L), q, q)
    assert torch.equal(got[0].isnan(), want[0].isnan())
