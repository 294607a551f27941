"""The fp32 modulation ops' NPU path (the modulation folded into torch_npu's layer norm) on
the doubles, where it cannot fold, and a missing package.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import ditops
import ditops.backends.npu
from ditops import config
from ditops.custom_op import BackendUnavailableError
from ditops.ops.modulation_fp32 import (
    layer_norm_scale_shift,
    scale_residual_layer_norm_scale_shift,
)
from tests.doubles.npu_attentions import Recorder, fake_attentions, no_attentions
from tests.doubles.npu_sgl_kernel import fake_sgl_kernel_npu
from tests.ops.test_modulation_fp32 import (
    ATOL,
    EPS,
    FRAMES,
    MODULATIONS,
    B,
    C,
    L,
    _params,
    _rnd,
    fp32_norm,
    wan_norm,
    wan_residual,
)
from tests.precision import assert_exact, assert_fast


@pytest.fixture
def npu_no_grad(on_npu: None) -> Any:
    """conftest's ``on_npu`` (CPU tensors take the npu paths), under ``torch.no_grad``."""
    with torch.no_grad():
        yield


@pytest.fixture
def spied_f_layer_norm(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    """Records the ``F.layer_norm`` calls of the NPU layer norm's torch_npu choice."""
    calls = Recorder()

    def layer_norm(*args: Any) -> torch.Tensor:
        calls.calls.append(("layer_norm", args))
        return F.layer_norm(*args)

    monkeypatch.setattr(ditops.backends.npu, "F", type("F", (), {"layer_norm": layer_norm}))
    return calls


@pytest.mark.parametrize("package", ["legacy", "current"])
@pytest.mark.parametrize("kind", ["batch", "frame", "vector"])
def test_npu_path_folds_modulation_into_layernorm(
    npu_no_grad: None, kind: str, package: str, caplog: Any, spied_f_layer_norm: Recorder
) -> None:
    # legacy: attentions.layernorm; current (sgl_kernel_npu, no layer norm): F.layer_norm of
    # the NPU tensor, run by torch_npu. Both take the modulation folded into fp32 affines.
    h, attn = torch.randn(B, L, C).bfloat16(), torch.randn(B, L, C).bfloat16()
    norm = fp32_norm(True)
    w, b = _params(norm)
    gate, scale, shift = (MODULATIONS[kind](torch.float32) for _ in range(3))
    setup = fake_attentions() if package == "legacy" else fake_sgl_kernel_npu()
    with setup as calls, caplog.at_level(logging.WARNING):
        assert (
            layer_norm_scale_shift.op.explain_call(h, w, b, scale, shift, EPS, None).chosen
            == "forward_npu"
        )
        out = layer_norm_scale_shift(h, w, b, scale, shift, EPS)
        fused, new_res = scale_residual_layer_norm_scale_shift(
            h, attn, gate, w, b, scale, shift, EPS
        )
    assert not [r for r in caplog.records if r.name == "ditops"]
    assert_fast(out, wan_norm(norm, h, scale, shift), atol=ATOL)
    ref_res = wan_residual(h, attn, gate)
    assert_exact(new_res, ref_res)
    assert_fast(fused, wan_norm(norm, ref_res, scale, shift), atol=ATOL)
    per_call = {"batch": B, "frame": B * FRAMES, "vector": 1}[kind]
    if package == "legacy":
        norm_calls = calls.of("layernorm")
        assert spied_f_layer_norm.calls == []
        for inp, shape, weight, bias, eps, impl_mode in norm_calls:
            assert inp.dtype == torch.bfloat16 and shape == [C] and impl_mode == 0
            assert weight.dtype == bias.dtype == torch.float32 and eps == pytest.approx(EPS)
    else:
        norm_calls = spied_f_layer_norm.of("layer_norm")
        assert calls.calls == []
        for inp, shape, weight, bias, eps in norm_calls:
            assert inp.dtype == torch.bfloat16 and tuple(shape) == (C,)
            assert weight.dtype == bias.dtype == torch.float32 and eps == pytest.approx(EPS)
    assert len(norm_calls) == 2 * per_call


def test_npu_runs_native_where_it_cannot_fold(npu_no_grad: None) -> None:
    h = torch.randn(B, L, C).bfloat16()
    scale = _rnd(B, L, C)
    with fake_attentions() as calls:
        decision = layer_norm_scale_shift.op.explain_call(h, None, None, scale, None, EPS, None)
        assert (
            decision.chosen == "forward_native" and "per-token" in decision.candidates[0].reasons[0]
        )
        assert_exact(
            layer_norm_scale_shift(h, None, None, scale, None, EPS),
            wan_norm(fp32_norm(False), h, scale, 0),
        )
        out_fp32 = layer_norm_scale_shift(h, None, None, _rnd(B, 1, C), None, EPS, torch.float32)
        assert out_fp32.dtype == torch.float32
        with config.override(precision="exact"):
            layer_norm_scale_shift(h, None, None, _rnd(B, 1, C), None, EPS)
    assert calls.calls == []


def test_npu_missing_falls_back_or_raises_in_strict_mode(npu_no_grad: None, caplog: Any) -> None:
    h, scale = torch.randn(B, L, C).bfloat16(), _rnd(B, 1, C)
    ref = wan_norm(fp32_norm(False), h, scale, 0)
    with no_attentions(), caplog.at_level(logging.WARNING):
        for _ in range(2):
            assert_exact(layer_norm_scale_shift(h, None, None, scale, None, EPS), ref)
        with (
            config.override(strict=True),
            pytest.raises(BackendUnavailableError, match="attentions"),
        ):
            layer_norm_scale_shift(h, None, None, scale, None, EPS)
    warnings = [r.getMessage() for r in caplog.records if r.name == "ditops"]
    assert len(warnings) == 1 and "not installed" in warnings[0]
