"""A patched forward on an accelerator never waits on the host (issue 17).

No GPU or NPU here: CPU tensors are dispatched as NPU tensors
(``force_device_kind({"cpu": "npu"})``) with the NPU test doubles of ``tests/doubles``
(written from the kernels' documented contracts), so every op takes its device paths
and the dispatcher treats the tensors as device tensors. A spy on the conversions of a
tensor to a Python value (``.item()``, ``.tolist()``, ``bool()``, ``int()``,
``float()``) counts those made from ditops' own code: on a real device each would be a
stall of the queue (and a break of CUDA graphs). There must be none.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import ditops
from ditops.attention import BlockSparseConfig
from ditops.platform import force_device_kind
from tests.doubles.npu_modules import fake_torch_npu_prologue
from tests.doubles.npu_sgl_kernel import fake_sgl_kernel_npu
from tests.integrations.spies import install_spies
from tests.integrations.test_diffusers_wan import inputs, run, tiny_wan

SRC = str(Path(ditops.__file__).resolve().parent)
CONVERSIONS = ("item", "tolist", "__bool__", "__int__", "__float__")


@pytest.fixture
def host_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The places in ditops' code that turned a tensor into a Python value."""
    seen: list[str] = []
    for name in CONVERSIONS:
        original = getattr(torch.Tensor, name)

        def spy(self: torch.Tensor, *a: object, _original=original, _name=name) -> object:
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(SRC):
                where = Path(caller.f_code.co_filename).relative_to(SRC)
                seen.append(f"{_name} at {where}:{caller.f_lineno}")
            return _original(self, *a)

        monkeypatch.setattr(torch.Tensor, name, spy)
    yield seen


def test_the_spy_sees_a_conversion_made_by_ditops(host_reads: list[str]) -> None:
    # The spy itself works: the CPU non-finite check reads its flag on the host.
    x = torch.randn(1, 2, 256, 64, dtype=torch.bfloat16)
    mask = torch.ones(1, 2, 2, 2, dtype=torch.int8)
    counts = torch.full((1, 2, 2), 2, dtype=torch.int32)
    with torch.no_grad():
        ditops.block_sparse_attention(x, x, x, mask, counts, block_size=128)
    assert any("__bool__" in r for r in host_reads)


def test_a_patched_forward_reads_nothing_back_from_the_device(
    monkeypatch: pytest.MonkeyPatch, host_reads: list[str]
) -> None:
    model = tiny_wan(keep_fp32=False)
    x = inputs(frames=4, hw=32)  # 4 x 16 x 16 = 1024 tokens: 8 blocks of 128
    cfg = BlockSparseConfig(
        sparsity=0.3, block_size=128, stride=16, skip_first_steps=0, method="antidiagonal"
    )
    ditops.patch(model, attention=cfg)
    ops = [c for c in ditops.registered_ops().values() if getattr(c, "forward_npu", None)]
    ran = install_spies(monkeypatch, ops, path="forward_npu")
    with fake_sgl_kernel_npu(), fake_torch_npu_prologue(), force_device_kind({"cpu": "npu"}):
        host_reads.clear()
        out = run(model, step=3, **x)
    assert torch.isfinite(out).all()
    # The device paths ran (else the test would prove nothing about them).
    assert {"block_sparse_attention", "estimate_block_mask", "fp32_layer_norm"} <= set(ran), ran
    assert host_reads == [], host_reads
