"""fp32_layer_norm's arguments are checked as the other ops' are: one short message
naming the argument, what it got and what is expected (ditops.ops.layer_norm)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ditops


def test_a_tensor_given_as_normalized_shape_is_named_not_printed() -> None:
    x = torch.randn(2, 64, 64)
    with pytest.raises(TypeError, match="normalized_shape must be an int or a sequence") as e:
        ditops.fp32_layer_norm(x, x)
    assert len(str(e.value)) < 300


@pytest.mark.parametrize("shape", [64, np.int64(64), [64], torch.Size([64])])
def test_an_int_normalized_shape_is_taken_as_layer_norm_takes_it(shape: object) -> None:
    x = torch.randn(2, 3, 64)
    want = torch.nn.functional.layer_norm(x, (64,))
    assert torch.equal(ditops.fp32_layer_norm(x, shape), want)


@pytest.mark.parametrize("shape", [-1, 0, 1.5, "64", [64.0], True, [True]])
def test_a_bad_normalized_shape_is_refused_in_words(shape: object) -> None:
    with pytest.raises((TypeError, ValueError), match="normalized_shape"):
        ditops.fp32_layer_norm(torch.randn(2, 64), shape)


@pytest.mark.parametrize("name", ["weight", "bias"])
def test_a_weight_or_bias_of_another_shape_or_device_is_refused(name: str) -> None:
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match=rf"{name} must have shape \[64\]"):
        ditops.fp32_layer_norm(x, (64,), **{name: torch.ones(32)})
    with pytest.raises(TypeError, match=rf"{name} must be a tensor"):
        ditops.fp32_layer_norm(x, (64,), **{name: [1.0] * 64})
    with pytest.raises(TypeError, match=rf"{name} has dtype int64"):
        ditops.fp32_layer_norm(x, (64,), **{name: torch.ones(64, dtype=torch.long)})
    with pytest.raises(ValueError, match=rf"{name} is on meta"):
        ditops.fp32_layer_norm(x, (64,), **{name: torch.ones(64, device="meta")})
