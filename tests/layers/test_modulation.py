"""The modulation layers (LayerNormScaleShift, ScaleResidualLayerNormScaleShift): their
state dicts round-trip with nn.LayerNorm's, and from_module shares the parameters.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ditops import config
from ditops.layers.modulation import LayerNormScaleShift, ScaleResidualLayerNormScaleShift
from tests.ops.test_modulation_fp32 import EPS, B, C, L, _rnd, fp32_norm, wan_norm
from tests.precision import assert_exact


@pytest.mark.parametrize("cls", [LayerNormScaleShift, ScaleResidualLayerNormScaleShift])
@pytest.mark.parametrize(
    "affine", [(True, True), (True, False), (False, False)], ids=["affine", "no_bias", "none"]
)
def test_state_dict_round_trip_with_layer_norms(cls: type, affine: tuple[bool, bool]) -> None:
    from diffusers.models.normalization import FP32LayerNorm

    elementwise, bias = affine
    for other in (
        nn.LayerNorm(C, EPS, elementwise, bias),
        FP32LayerNorm(C, EPS, elementwise, bias),
    ):
        with torch.no_grad():
            for p in other.parameters():
                p.normal_()
        ours = cls(C, eps=EPS, elementwise_affine=elementwise, bias=bias)
        assert ours.state_dict().keys() == other.state_dict().keys()
        ours.load_state_dict(other.state_dict())
        back = type(other)(C, EPS, elementwise, bias)
        back.load_state_dict(ours.state_dict())
        for a, b in zip(back.parameters(), other.parameters()):
            assert torch.equal(a, b)


def test_from_module_shares_parameters_and_matches() -> None:
    norm = fp32_norm(True)
    mod = LayerNormScaleShift.from_module(norm, precision="exact")
    assert mod.weight is norm.weight and mod.bias is norm.bias and mod.eps == EPS
    x, scale, shift = torch.randn(B, L, C).bfloat16(), _rnd(B, 1, C), _rnd(B, 1, C)
    with torch.no_grad(), config.override(precision="fast"):  # the module's precision wins
        assert_exact(mod(x, scale, shift), wan_norm(norm, x, scale, shift))
    fused = ScaleResidualLayerNormScaleShift.from_module(nn.LayerNorm(C, elementwise_affine=False))
    assert fused.weight is None and fused.bias is None and fused.eps == 1e-5
    with pytest.raises(TypeError, match="expects an nn.LayerNorm"):
        LayerNormScaleShift.from_module(nn.Linear(C, C))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one int C"):
        LayerNormScaleShift((4, C))
    with pytest.raises(ValueError, match="precision"):
        LayerNormScaleShift(C, precision="fastest")
