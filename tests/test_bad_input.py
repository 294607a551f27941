"""The public API on bad input: one table, so the next regression is caught (issue 10).

Each case is what a user might pass, the exception ditops raises and a fragment of its
message (which must say what was wrong or what is allowed). Where the meaning itself
accepts something (a negative eps, as ``nn.LayerNorm`` does), ditops accepts it too, and
the second table checks that it computes what the meaning computes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import ditops
from ditops import config

x8 = torch.randn(2, 8)
bf = torch.randn(1, 4, 8, dtype=torch.bfloat16)
q = torch.randn(1, 2, 256, 16)
mask = torch.ones(1, 2, 2, 2, dtype=torch.int8)
counts = mask.sum(-1, dtype=torch.int32)


def _norm_on(x: torch.Tensor) -> Callable[[], Any]:
    return lambda: ditops.FP32LayerNorm(8)(x)


def _precision(value: Any) -> Callable[[], Any]:
    def set_it() -> None:
        ditops.FP32LayerNorm(8).precision = value

    return set_it


def _enter(cm: Any) -> Callable[[], Any]:
    def enter() -> None:
        with cm():
            pass

    return enter


CASES: list[tuple[str, Callable[[], Any], type[BaseException], str]] = [
    # configuration
    (
        "configure bad precision",
        lambda: ditops.configure(precision="quick"),
        config.ConfigError,
        "expected 'fast' or 'exact'",
    ),
    (
        "configure unknown op",
        lambda: ditops.configure(custom_ops="+nope"),
        config.ConfigError,
        "names unknown op(s) nope",
    ),
    (
        "configure custom_ops not a string",
        lambda: ditops.configure(custom_ops=1),
        config.ConfigError,
        "must be a string",
    ),
    (
        "configure strict not a bool",
        lambda: ditops.configure(strict="yes"),
        config.ConfigError,
        "strict must be a bool",
    ),
    (
        "override bad precision",
        _enter(lambda: ditops.override(precision="EXACTLY")),
        config.ConfigError,
        "expected 'fast' or 'exact'",
    ),
    (
        "force_device_kind unknown kind",
        _enter(lambda: ditops.force_device_kind({"cpu": "tpu"})),
        ValueError,
        "known kinds are",
    ),
    (
        "device_kind of a number",
        lambda: ditops.device_kind(3),
        TypeError,
        "expects a tensor, torch.device or str",
    ),
    ("explain unknown op", lambda: ditops.explain("nope"), KeyError, "no op named"),
    (
        "explain bad precision",
        lambda: ditops.explain(precision="fastest"),
        ValueError,
        "precision must be one of",
    ),
    # FP32LayerNorm
    (
        "norm on ints",
        _norm_on(torch.ones(2, 8, dtype=torch.int64)),
        TypeError,
        "not a floating point type",
    ),
    (
        "norm wrong trailing dim",
        _norm_on(torch.randn(2, 7)),
        ValueError,
        "does not end in normalized_shape",
    ),
    ("norm precision foo", _precision("foo"), ValueError, "must be 'fast', 'exact' or None"),
    ("norm precision EXACT", _precision("EXACT"), ValueError, "must be 'fast', 'exact' or None"),
    (
        "from_module of a Linear",
        lambda: ditops.FP32LayerNorm.from_module(torch.nn.Linear(2, 2)),
        TypeError,
        "expects an nn.LayerNorm",
    ),
    # modulation
    (
        "modulation scale of a wrong width",
        lambda: ditops.layer_norm_scale_shift(bf, None, None, torch.zeros(7), None, 1e-6),
        ValueError,
        "scale",
    ),
    (
        "modulation eps a string",
        lambda: ditops.layer_norm_scale_shift(bf, None, None, None, None, "1e-6"),
        TypeError,
        "eps must be a real number",
    ),
    (
        "gated residual shapes differ",
        lambda: ditops.gated_residual(bf, torch.zeros(1, 4, 7, dtype=torch.bfloat16)),
        ValueError,
        "expected the residual's shape",
    ),
    (
        "gated residual dtype",
        lambda: ditops.gated_residual(bf, bf.half()),
        TypeError,
        "expected the residual's dtype",
    ),
    (
        "LayerNormScaleShift two dims",
        lambda: ditops.LayerNormScaleShift((2, 4)),
        ValueError,
        "normalises the last dim only",
    ),
    (
        "LayerNormScaleShift precision",
        lambda: ditops.LayerNormScaleShift(8, precision="exactly"),
        ValueError,
        "precision must be",
    ),
    # attention
    (
        "attention 3-D q",
        lambda: ditops.block_sparse_attention(q[0], q, q, mask, counts),
        ValueError,
        "must be 4-D",
    ),
    (
        "attention bad layout",
        lambda: ditops.block_sparse_attention(q, q, q, mask, counts, layout="BHSD"),
        ValueError,
        "layout must be one of",
    ),
    (
        "attention counts not row sums",
        lambda: ditops.block_sparse_attention(q, q, q, mask, counts + 1),
        ValueError,
        "counts must equal the row sums",
    ),
    (
        "attention mask of 2s",
        lambda: ditops.block_sparse_attention(q, q, q, mask * 2, counts * 2),
        ValueError,
        "must be 0 or 1",
    ),
    (
        "attention scale zero",
        lambda: ditops.block_sparse_attention(q, q, q, mask, counts, scale=0.0),
        ValueError,
        "scale must be None or a positive number",
    ),
    (
        "estimate stride not dividing",
        lambda: ditops.estimate_block_mask(q, q, block_size=32, stride=5),
        ValueError,
        "must be a multiple of stride",
    ),
    (
        "estimate keep_ratio 0",
        lambda: ditops.estimate_block_mask(q, q, keep_ratio=0.0),
        ValueError,
        "keep_ratio must be in (0, 1]",
    ),
    (
        "config sparsity 1",
        lambda: ditops.BlockSparseConfig(sparsity=1.0),
        ValueError,
        "sparsity must be in [0, 1)",
    ),
    (
        "config sparsity NaN",
        lambda: ditops.BlockSparseConfig(sparsity=float("nan")),
        ValueError,
        "got NaN",
    ),
    (
        "config skip a float",
        lambda: ditops.BlockSparseConfig(skip_first_steps=1.5),
        TypeError,
        "skip_first_steps must be an int",
    ),
    (
        "layer config and fields",
        lambda: ditops.BlockSparseAttention(ditops.BlockSparseConfig(), sparsity=0.5),
        TypeError,
        "give a config or its fields, not both",
    ),
    # patching
    (
        "patch an object",
        lambda: ditops.patch(object()),
        ditops.PatchError,
        "expects a diffusers model",
    ),
    (
        "patch attention=0.5",
        lambda: ditops.patch(torch.nn.Linear(2, 2), attention=0.5),
        ditops.PatchError,
        "BlockSparseConfig(sparsity=...)",
    ),
    (
        "patch precision",
        lambda: ditops.patch(torch.nn.Linear(2, 2), precision="exactly"),
        ditops.PatchError,
        "precision must be one of",
    ),
    (
        "patch generic model with attention",
        lambda: ditops.patch(torch.nn.Linear(2, 2), attention=ditops.BlockSparseConfig()),
        ditops.PatchError,
        "sparse attention is supported for WanTransformer3DModel",
    ),
    (
        "set_step on an unpatched model",
        lambda: ditops.set_step(torch.nn.Linear(2, 2), 1),
        ValueError,
        "was not patched with sparse attention",
    ),
]


@pytest.mark.parametrize(
    ("call", "error", "fragment"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_input_is_refused_with_a_clear_message(
    call: Callable[[], Any], error: type[BaseException], fragment: str
) -> None:
    before = config.get()
    with torch.no_grad(), pytest.raises(error) as info:
        call()
    assert fragment in str(info.value)
    assert config.get() == before  # a refused call changed no setting


def test_a_refused_call_leaves_the_fast_paths_on() -> None:
    norm = ditops.FP32LayerNorm(8)
    with torch.no_grad():
        for _, call, error, _ in CASES:
            with pytest.raises(error):
                call()
        assert norm.explain_call(x8).chosen == "forward_cpu"


ACCEPTED: list[tuple[str, Callable[[], torch.Tensor], Callable[[], torch.Tensor]]] = [
    (
        "negative eps, as nn.LayerNorm",
        lambda: ditops.FP32LayerNorm(8, eps=-1e-3)(x8),
        lambda: F.layer_norm(x8, (8,), torch.ones(8), torch.zeros(8), -1e-3),
    ),
    (
        "zero eps",
        lambda: ditops.FP32LayerNorm(8, eps=0.0)(x8),
        lambda: F.layer_norm(x8, (8,), torch.ones(8), torch.zeros(8), 0.0),
    ),
    (
        "an empty batch",
        lambda: ditops.FP32LayerNorm(8)(torch.randn(0, 8)),
        lambda: torch.randn(0, 8),
    ),
    (
        "a gate of 1 (no gating)",
        lambda: ditops.gated_residual(bf, bf, 1),
        lambda: (bf.float() + bf).to(bf.dtype),
    ),
]


@pytest.mark.parametrize(
    ("call", "meaning"), [c[1:] for c in ACCEPTED], ids=[c[0] for c in ACCEPTED]
)
def test_what_the_meaning_accepts_is_accepted(
    call: Callable[[], torch.Tensor], meaning: Callable[[], torch.Tensor]
) -> None:
    with torch.no_grad():
        out, want = call(), meaning()
    assert out.shape == want.shape and out.dtype == want.dtype
    assert torch.allclose(out.float(), want.float(), equal_nan=True, atol=1e-6)
