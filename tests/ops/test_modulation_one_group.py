"""The modulation meanings with one group (``[C]``, ``[B, 1, C]``, a number, a 0-d
tensor) read the modulation against ``[B, L, C]`` directly (issue 39: no grouped views
per call); the bits are eager's literal expressions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ditops

MODS = {
    "vector": lambda c, dt: torch.randn(c, dtype=dt),
    "per_batch": lambda c, dt: torch.randn(2, 1, c, dtype=dt),
    "number": lambda c, dt: 0.75,
    "zero_dim": lambda c, dt: torch.tensor(0.75, dtype=dt),
}


@pytest.mark.parametrize("form", list(MODS))
@pytest.mark.parametrize("mod_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_group_meanings_are_eagers_bits(form: str, mod_dtype: torch.dtype) -> None:
    x, res = torch.randn(2, 7, 24).bfloat16(), torch.randn(2, 7, 24).bfloat16()
    w, b = torch.randn(24), torch.randn(24)
    g, s, t = (MODS[form](24, mod_dtype) for _ in range(3))
    with ditops.override(custom_ops="none"):  # the meaning on every op
        assert torch.equal(ditops.adaln_residual(res, x, g), res + g * x)
        assert torch.equal(
            ditops.adaln_modulate(x, s, t), F.layer_norm(x, (24,), None, None, 1e-6) * (1 + s) + t
        )
        assert torch.equal(ditops.gated_residual(res, x, g), (res.float() + x * g).to(res.dtype))
        want = (F.layer_norm(x.float(), (24,), w, b, 1e-5) * (1 + s) + t).to(x.dtype)
        assert torch.equal(ditops.layer_norm_scale_shift(x, w, b, s, t), want)
