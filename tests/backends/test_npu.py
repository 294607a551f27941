"""The NPU backends: which sgl-kernel-npu layout each kernel resolves to, torch_npu probes,
the test doubles' own contract, and what ``ditops info`` says with each double installed.

Every test starts from conftest's ``on_npu`` (no NPU package importable, CPU tensors
dispatched as NPU tensors) and installs the doubles it needs.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest
import torch

from ditops.backends import npu
from ditops.cli import main
from ditops.ops.attention_npu import NPU_ATTENTION, NPU_ESTIMATE, inner_precise
from tests.doubles.npu_attentions import fake_attentions
from tests.doubles.npu_modules import (
    DocumentedContractError,
    fake_torch_npu,
    fake_torch_npu_prologue,
    npu_rms_norm,
    npu_rotary_mul,
)
from tests.doubles.npu_sgl_kernel import (
    ContractError,
    fake_sgl_kernel_npu,
    sgl_kernel_npu_without_torch_npu,
)

# --- which package each kernel resolves to -----------------------------------------------


def test_current_package_first_then_legacy_per_op(on_npu: None) -> None:
    # A current build without the estimator (per op): attention from sgl_kernel_npu, the
    # estimate from the legacy package.
    with fake_sgl_kernel_npu(ops=["ada_block_sparse_attention"]), fake_attentions():
        attention, estimate = NPU_ATTENTION.resolved(), NPU_ESTIMATE.resolved()
        notes = NPU_ESTIMATE.notes
    assert attention.package is npu.SGL_KERNEL_NPU
    assert attention.qualified == "torch.ops.npu.ada_block_sparse_attention"
    assert attention.via.startswith("sgl_kernel_npu.attentions.ada_block_sparse_attention")
    assert estimate.package is npu.LEGACY_ATTENTIONS
    assert estimate.qualified == "torch.ops.attentions.sparse_block_estimate"
    assert notes == ["sgl_kernel_npu: no sparse_block_estimate"]


def test_legacy_package_under_the_old_op_name(on_npu: None) -> None:
    with fake_attentions(ops=["block_sparse_attention"]):
        call = NPU_ATTENTION.resolved()
        name = NPU_ATTENTION.name
    assert call.qualified == "torch.ops.attentions.block_sparse_attention"
    assert name == (
        "attentions: torch.ops.attentions.block_sparse_attention (sgl_kernel_npu: not installed)"
    )
    assert inner_precise(call, torch.float16) == 0


def test_nothing_installed_reasons_name_both_packages_and_the_current_wheel(on_npu: None) -> None:
    reasons = NPU_ATTENTION.probe()
    assert len(reasons) == 2
    assert reasons[0].startswith("sgl_kernel_npu is not installed")
    assert reasons[1].startswith("the legacy 'attentions' package is not installed")
    assert (
        "install the sgl_kernel_npu wheel built from github.com/sgl-project/sgl-kernel-npu"
        in (reasons[1])
    )
    with pytest.raises(RuntimeError, match="sgl_kernel_npu is not installed"):
        NPU_ATTENTION.op()


def test_sgl_kernel_npu_without_torch_npu(on_npu: None) -> None:
    with sgl_kernel_npu_without_torch_npu():
        reasons = NPU_ATTENTION.probe()
    assert reasons[0] == "sgl_kernel_npu failed to import (No module named 'torch_npu')"


def test_probes_are_forgotten_when_packages_change(on_npu: None) -> None:
    assert NPU_ATTENTION.probe()
    with fake_sgl_kernel_npu():
        assert NPU_ATTENTION.probe() == []
    assert NPU_ATTENTION.probe() and NPU_ATTENTION.call is None


def test_inner_precise_per_package_and_dtype(on_npu: None) -> None:
    with fake_sgl_kernel_npu():
        current = NPU_ATTENTION.resolved()
    with fake_attentions():
        legacy = NPU_ATTENTION.resolved()
    assert inner_precise(current, torch.float16) == 1
    assert inner_precise(current, torch.bfloat16) == 0
    assert inner_precise(legacy, torch.float16) == 0


# --- torch_npu --------------------------------------------------------------------------


def test_torch_npu_op_checks_named_functions(on_npu: None) -> None:
    def rms_norm(x: torch.Tensor) -> torch.Tensor:
        return x

    rms = npu.torch_npu_op("npu_rms_norm")
    assert rms is npu.torch_npu_op("npu_rms_norm") and rms.name == "torch_npu (npu_rms_norm)"
    assert npu.TORCH_NPU is npu.torch_npu_op()
    not_installed = rms.probe()
    with fake_torch_npu({"npu_rms_norm": rms_norm}):
        assert rms.probe() == [] and npu.TORCH_NPU.probe() == []
        assert rms.function("npu_rms_norm") is rms_norm
        with pytest.raises(ValueError, match="not asked for torch_npu.npu_rotary_mul"):
            rms.function("npu_rotary_mul")
    with fake_torch_npu():
        (missing,) = rms.probe()
        assert npu.TORCH_NPU.probe() == []
    assert not_installed[0].startswith("torch_npu is not installed")
    assert "install torch_npu for your CANN version" in not_installed[0]
    assert missing.startswith("the installed torch_npu (2.13.0.test-double) has no ")
    assert "torch_npu.npu_rms_norm" in missing


# --- the doubles follow the documented contracts ----------------------------------------


def _attention_args(dtype: torch.dtype, sparse_size: int = 128) -> tuple[Any, ...]:
    q = torch.randn(1, 1, 128, 16).to(dtype)
    mask = torch.ones(1, 1, 1, 1, dtype=torch.int8)
    return (q, q, q, mask, mask.sum(-1, dtype=torch.int32), "BNSD", sparse_size)


def test_current_wrappers_raise_when_the_soc_has_no_kernel(on_npu: None) -> None:
    with fake_sgl_kernel_npu(ops=[]) as calls:
        from sgl_kernel_npu.attentions import ada_block_sparse_attention, sparse_block_estimate

        for wrapper, args in (
            (ada_block_sparse_attention, _attention_args(torch.bfloat16)),
            (sparse_block_estimate, _attention_args(torch.bfloat16)[:2]),
        ):
            with pytest.raises(RuntimeError, match=r"was not built for this SoC"):
                wrapper(*args)
    assert calls.calls == [] and sys.modules["sgl_kernel_npu"] is None  # on_npu's, restored


@pytest.mark.parametrize(
    ("dtype", "inner_precise", "sparse_size", "error"),
    [
        (torch.float16, 0, 128, "fp16 with inner_precise 0"),
        (torch.float16, 2, 128, "fp16 with inner_precise 2"),
        (torch.bfloat16, 0, 64, "sparse_size 64 not a multiple of 128"),
        (torch.bfloat16, 0, 640, "sparse_size 640 not a multiple of 128 in"),
        (torch.float16, 1, 128, None),
        (torch.bfloat16, 0, 256, None),
    ],
)
def test_current_double_checks_the_documented_arguments(
    on_npu: None, dtype: torch.dtype, inner_precise: int, sparse_size: int, error: str | None
) -> None:
    args = _attention_args(dtype, sparse_size)
    with fake_sgl_kernel_npu():
        from sgl_kernel_npu.attentions import ada_block_sparse_attention

        def call() -> torch.Tensor:
            return ada_block_sparse_attention(*args, inner_precise=inner_precise)

        if error is None:
            assert call().shape == args[0].shape
        else:
            with pytest.raises(ContractError, match=error):
                call()


def test_current_double_checks_the_estimator_stride(on_npu: None) -> None:
    q = torch.randn(1, 1, 128, 16).bfloat16()
    with fake_sgl_kernel_npu():
        from sgl_kernel_npu.attentions import sparse_block_estimate

        with pytest.raises(ContractError, match="stride 3 does not divide sparse_size 256"):
            sparse_block_estimate(q, q, stride=3, sparse_size=256)
        with pytest.raises(ContractError, match="layout TND"):
            sparse_block_estimate(q, q, input_layout="TND")


def test_legacy_double_takes_fp16_high_precision(on_npu: None) -> None:
    args = _attention_args(torch.float16)
    with fake_attentions():
        out = torch.ops.attentions.ada_block_sparse_attention(*args, inner_precise=0)
    assert out.shape == args[0].shape


def test_doubles_tear_down(on_npu: None) -> None:
    with fake_sgl_kernel_npu(), fake_attentions():
        assert hasattr(torch.ops.npu, "ada_block_sparse_attention")
        assert "sgl_kernel_npu.attentions" in sys.modules
    assert not hasattr(torch.ops.npu, "ada_block_sparse_attention")
    assert not hasattr(torch.ops.attentions, "layernorm")
    for name in ("sgl_kernel_npu", "sgl_kernel_npu.attentions", "attentions", "torch_npu"):
        assert sys.modules[name] is None  # on_npu's "not installed", restored


def test_torch_npu_prologue_doubles_refuse_what_is_not_documented() -> None:
    x = torch.randn(2, 3, 4, 8).bfloat16()
    table = torch.rand(1, 3, 1, 8)
    with pytest.raises(DocumentedContractError, match="gamma in self's dtype"):
        npu_rms_norm(x.flatten(0, 2), torch.ones(8))  # fp32 gamma with bf16 self
    with pytest.raises(DocumentedContractError, match="one dtype"):
        npu_rotary_mul(x, table, table)  # fp32 tables with bf16 input
    x32 = x.float()
    with pytest.raises(DocumentedContractError, match="outside the documented layouts"):
        npu_rotary_mul(x32, table.expand(2, 3, 1, 8), table.expand(2, 3, 1, 8), "interleave")
    with pytest.raises(DocumentedContractError, match=r"\[-1, 1\]"):
        npu_rotary_mul(x32, table * 3, table)
    y, rstd = npu_rms_norm(x.flatten(0, 2), torch.ones(8).bfloat16(), 1e-6)
    assert y.dtype == torch.bfloat16 and rstd.dtype == torch.float32 and rstd.shape == (24, 1)
    assert npu_rotary_mul(x32, table, table, "interleave").shape == x.shape


# --- ditops info ----------------------------------------------------------------------------


def info(capsys: pytest.CaptureFixture[str]) -> dict[tuple[str, str], dict[str, Any]]:
    """``ditops info --json``: the npu candidate of every op, by (op, device kind)."""
    assert main(["info", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    return {
        (d["op"], d["device_kind"]): {"chosen": d["chosen"], **d["candidates"][0]}
        for d in payload["ops"]
        if d["device_kind"] == "npu"
    }


def test_info_with_the_current_package(on_npu: None, capsys: pytest.CaptureFixture[str]) -> None:
    with fake_sgl_kernel_npu():
        ops = info(capsys)
    attention = ops[("block_sparse_attention", "npu")]
    assert attention["chosen"] == "forward_npu" and attention["reasons"] == []
    assert attention["accepts"].endswith(
        "needs sgl_kernel_npu: sgl_kernel_npu.attentions.ada_block_sparse_attention -> "
        "torch.ops.npu.ada_block_sparse_attention"
    )
    estimate = ops[("estimate_block_mask", "npu")]
    assert (
        "needs sgl_kernel_npu: sgl_kernel_npu.attentions.sparse_block_estimate"
        in (estimate["accepts"])
    )
    for op in (
        "fp32_layer_norm",
        "layer_norm_scale_shift",
        "scale_residual_layer_norm_scale_shift",
    ):
        norm = ops[(op, "npu")]
        assert norm["chosen"] == "forward_npu"
        assert "needs torch_npu: F.layer_norm with fp32 weight and bias" in norm["accepts"]
        assert (
            "no layernorm kernel: sgl_kernel_npu: ships none; attentions: not installed"
            in (norm["accepts"])
        )


def test_info_with_the_legacy_package(on_npu: None, capsys: pytest.CaptureFixture[str]) -> None:
    with fake_attentions():
        ops = info(capsys)
    attention = ops[("block_sparse_attention", "npu")]
    assert attention["chosen"] == "forward_npu"
    assert (
        "needs attentions: torch.ops.attentions.ada_block_sparse_attention "
        "(sgl_kernel_npu: not installed)" in attention["accepts"]
    )
    norm = ops[("fp32_layer_norm", "npu")]
    assert "needs attentions: torch.ops.attentions.layernorm, impl_mode 0" in norm["accepts"]


def test_info_with_neither(on_npu: None, capsys: pytest.CaptureFixture[str]) -> None:
    ops = info(capsys)
    attention = ops[("block_sparse_attention", "npu")]
    assert attention["chosen"] == "forward_native"
    assert attention["reasons"][0].startswith("sgl_kernel_npu is not installed")
    assert "install the sgl_kernel_npu wheel" in attention["reasons"][1]
    norm = ops[("fp32_layer_norm", "npu")]
    assert norm["chosen"] == "forward_native"
    assert any(r.startswith("torch_npu is not installed") for r in norm["reasons"])


def test_info_names_the_torch_npu_functions(
    on_npu: None, capsys: pytest.CaptureFixture[str]
) -> None:
    with fake_torch_npu_prologue():
        ops = info(capsys)
    for op, needs in (
        ("rms_norm", "needs torch_npu (npu_rms_norm)"),
        ("rotary_embedding", "needs torch_npu (npu_rotary_mul)"),
        ("qk_norm_rope", "needs torch_npu (npu_rms_norm, npu_rotary_mul)"),
    ):
        assert ops[(op, "npu")]["chosen"] == "forward_npu"
        assert needs in ops[(op, "npu")]["accepts"]
    with fake_torch_npu({"npu_rms_norm": npu_rms_norm}):
        ops = info(capsys)
    assert ops[("rms_norm", "npu")]["chosen"] == "forward_npu"
    rotary = ops[("rotary_embedding", "npu")]
    assert rotary["chosen"] == "forward_native"
    assert "has no torch_npu.npu_rotary_mul" in rotary["reasons"][0]
