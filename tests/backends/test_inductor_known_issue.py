"""The README's known issue (NaN from inductor around ditops' kernels, bf16, on a CPU with
AMX; issue 25, item 9) warns once where it is known to fail.

This machine may lack AMX: whether the CPU has AMX tiles is replaced by a double
(``inductor_cpu.amx_tiles``, the one probe ditops asks), so both answers are tested here.
The compiles are real (inductor on a graph of one ditops kernel: it only calls it, so
there is little C++ to build); the warning is given while the graph is traced.
"""

from __future__ import annotations

import logging

import pytest
import torch

from ditops.backends import inductor_cpu
from ditops.kernels.cpu.layer_norm import fp32_layer_norm


def _norm(x: torch.Tensor) -> torch.Tensor:
    return fp32_layer_norm(x, [x.shape[-1]], None, None, 1e-6, False)


def _compile_and_run(backend: str, dtype: torch.dtype, rows: int = 4) -> torch.Tensor:
    torch._dynamo.reset()
    x = torch.randn(1, rows, 32).to(dtype)
    return torch.compile(_norm, backend=backend, fullgraph=True)(x)


@pytest.fixture
def warnings_seen(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture):
    monkeypatch.setattr(inductor_cpu, "_warned_known_issue", [])
    caplog.set_level(logging.WARNING, logger="ditops")

    def seen() -> list[str]:
        return [r.getMessage() for r in caplog.records if "AMX" in r.getMessage()]

    yield seen
    torch._dynamo.reset()


def test_inductor_bf16_on_an_amx_cpu_warns_once(
    monkeypatch: pytest.MonkeyPatch, warnings_seen
) -> None:
    monkeypatch.setattr(inductor_cpu, "amx_tiles", lambda: True)
    out = _compile_and_run("inductor", torch.bfloat16)
    assert torch.isfinite(out).all()
    assert len(warnings_seen()) == 1
    message = warnings_seen()[0]
    assert "issue 25" in message and "Known issues" in message
    assert "backend='aot_eager'" in message and "unpatched" in message
    _compile_and_run("inductor", torch.bfloat16, rows=6)  # traced again: no second warning
    assert len(warnings_seen()) == 1


@pytest.mark.parametrize(
    ("amx", "backend", "dtype"),
    [
        (False, "inductor", torch.bfloat16),  # no AMX (this EPYC: right, 0.0078 from eager)
        (True, "aot_eager", torch.bfloat16),  # the workaround
        (True, "inductor", torch.float32),  # not the dtype that failed
        (True, "inductor", torch.float16),
    ],
    ids=["no_amx", "aot_eager", "fp32", "fp16"],
)
def test_other_combinations_stay_quiet(
    amx: bool, backend: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch, warnings_seen
) -> None:
    monkeypatch.setattr(inductor_cpu, "amx_tiles", lambda: amx)
    _compile_and_run(backend, dtype)
    assert warnings_seen() == []


def test_an_eager_call_never_asks() -> None:
    asked: list[bool] = []
    mp = pytest.MonkeyPatch()
    mp.setattr(inductor_cpu, "amx_tiles", lambda: asked.append(True) or True)
    try:
        _norm(torch.randn(1, 4, 32).bfloat16())
    finally:
        mp.undo()
    assert asked == []
