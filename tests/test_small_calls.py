"""The small-call rule (issue 39): a CPU call under ``SMALL_CALL_ELEMENTS`` runs the
meaning (a static rule by size, in both precisions, whatever ``DITOPS_TUNE`` says), so a
small tensor never pays a path's per-call work (the tuner's lookup, the block walk); an
op whose meaning does not compete, or that opts out, keeps its path."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

import ditops
from ditops import config
from ditops.core import plan as plan_module
from ditops.core.op import CustomOp, register_op
from ditops.core.paths import NATIVE, path
from ditops.kernels.cpu import layer_norm as LN

RAN: list[str] = []


@register_op("toy_small_same_bits")
class ToySameBits(CustomOp):
    """Meaning: x + 1; the path computes the same expression (the meaning's bits)."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        RAN.append(NATIVE)
        return x + 1

    @path(precisions=("exact", "fast"), fast_bits="native")
    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        RAN.append("forward_cpu")
        return x + 1


@register_op("toy_small_own_bits")
class ToyOwnBits(CustomOp):
    """In ``fast`` the path rounds its own way (no ``fast_bits``)."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        RAN.append(NATIVE)
        return x + 1

    @path(precisions=("exact", "fast"))
    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        RAN.append("forward_cpu")
        return x + 1


same_bits, own_bits = ToySameBits(), ToyOwnBits()


@pytest.fixture(autouse=True)
def _rule_on(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> Iterator[None]:
    monkeypatch.setattr(plan_module, "SMALL_CALL_ELEMENTS", 64)
    monkeypatch.setenv("DITOPS_CACHE_DIR", str(tmp_path))
    RAN.clear()
    plan_module.forget()
    yield
    plan_module.forget()


@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_a_small_call_runs_the_meaning_where_the_bits_are_the_meanings(precision: str) -> None:
    x = torch.randn(4, 16)  # 64 elements
    with config.override(tune="cache", precision=precision):
        assert torch.equal(same_bits(x), x + 1)
        decision = same_bits.explain_call(x)
    assert RAN == [NATIVE]
    assert decision.chosen == NATIVE
    assert "small call (64 elements <= 64)" in decision.tuned


def test_exact_calls_of_a_path_with_its_own_fast_bits_are_small_calls_too() -> None:
    x = torch.randn(4, 16)
    with config.override(tune="cache", precision="exact"):
        own_bits(x)
    assert RAN == [NATIVE]


@pytest.mark.parametrize("tune", ["off", "on", "cache"])
@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_the_rule_is_static_whatever_the_tuning_mode(tune: str, precision: str) -> None:
    x = torch.randn(4, 16)
    with config.override(tune=tune, precision=precision):
        assert torch.equal(own_bits(x), x + 1)
    assert RAN == [NATIVE]


@register_op("toy_small_oracle")
class ToyOracle(ToyOwnBits):
    """The meaning is a memory-bound oracle (it does not compete)."""

    meaning_competes = False


@register_op("toy_small_opted_out")
class ToyOptedOut(ToyOwnBits):
    small_calls_run_meaning = False


@pytest.mark.parametrize("cls", [ToyOracle, ToyOptedOut])
def test_an_oracle_or_an_op_that_opts_out_keeps_its_path(cls: type[CustomOp]) -> None:
    x = torch.randn(4, 16)
    with config.override(tune="cache", precision="exact"):
        cls()(x)
        assert cls().explain_call(x).tuned == ""
    assert RAN == ["forward_cpu"]


def test_estimate_block_mask_opts_out() -> None:
    assert ditops.estimate_block_mask.op.small_calls_run_meaning is False


def test_a_larger_call_is_not_small() -> None:
    x = torch.randn(5, 13)  # 65 elements; nothing recorded, "cache" times nothing
    with config.override(tune="cache", precision="exact"):
        same_bits(x)
        decision = same_bits.explain_call(x)
    assert RAN == ["forward_cpu"]
    assert decision.chosen == "forward_cpu"


def test_other_device_kinds_keep_their_paths() -> None:
    x = torch.randn(4, 16)
    with config.override(tune="cache", precision="exact"), ditops.force_device_kind({"cpu": "npu"}):
        assert same_bits.explain_call(x).tuned == ""


def test_fp32_layer_norm_small_exact_call_is_bitwise_and_skips_the_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kernel_calls: list[int] = []
    real = LN.fp32_layer_norm

    def spy(*args: object) -> torch.Tensor:
        kernel_calls.append(1)
        return real(*args)

    monkeypatch.setattr(LN, "fp32_layer_norm", spy)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    w, b = torch.randn(16), torch.randn(16)
    with config.override(tune="cache", precision="exact"), torch.inference_mode():
        out = ditops.fp32_layer_norm(x, (16,), w, b)
        assert kernel_calls == []
        big = torch.randn(8, 16, dtype=torch.bfloat16)  # 128 elements: the kernel
        ditops.fp32_layer_norm(big, (16,), w, b)
        assert kernel_calls == [1]
    assert torch.equal(out, F.layer_norm(x.float(), (16,), w, b, 1e-5).to(x.dtype))


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_layer_norm_kernel_on_one_block_is_the_meaning(
    monkeypatch: pytest.MonkeyPatch, exact: bool, dtype: torch.dtype
) -> None:
    """One block (rows <= a block's rows) takes the expression itself, not the walk."""
    walks: list[int] = []
    monkeypatch.setattr(LN.workers, "run_blocks", lambda n, body: walks.append(n))
    x = torch.randn(3, 5, 96, dtype=dtype)
    w, b = torch.randn(96), torch.randn(96)
    with torch.inference_mode():
        out = LN.fp32_layer_norm(x, [96], w, b, 1e-6, exact)
    assert walks == []
    assert torch.equal(out, F.layer_norm(x.float(), [96], w, b, 1e-6).to(dtype))
