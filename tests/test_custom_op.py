"""The dispatcher: registry, per-call device dispatch, the fallback matrix, explanations.

Uses toy ops with a controllable fake Backend (a test double for an optional package):
its probe reports "not installed" or "op missing" as told, and its kernel can raise.
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from torch import nn

import ditops
from ditops import config
from ditops.backends.base import Backend
from ditops.core import plan
from ditops.custom_op import (
    Args,
    BackendUnavailableError,
    CustomOp,
    explain,
    fast_path,
    register_op,
    reset_state,
)
from ditops.platform import force_device_kind


class FakeBackend(Backend):
    name = "fakelib"
    install_hint = "pip install fakelib"

    def __init__(self) -> None:
        super().__init__()
        self.reasons: list[str] = []
        self.raise_at_run_time = False

    def _probe(self) -> list[str]:
        return list(self.reasons)


FAKE = FakeBackend()


@register_op("toy_scale")
class ToyScale(CustomOp):
    """Meaning: 2 * x. Fast paths are marked by adding 0 (same values) and logging the path."""

    def __init__(self) -> None:
        super().__init__()
        self.ran: list[str] = []
        self.lock = threading.Lock()

    def _mark(self, path: str) -> None:
        with self.lock:
            self.ran.append(path)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        self._mark("native")
        if x.numel() == 7:
            raise ValueError("the meaning refuses 7 elements")  # a caller's mistake
        return x * 2

    @fast_path(precisions=("exact", "fast"), dtypes=(torch.float32,), inference_only=True)
    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        self._mark("cpu")
        return x + x

    @fast_path(backend=FAKE, precisions=("fast",))
    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        self._mark("cuda")
        if FAKE.raise_at_run_time or x.numel() == 7:
            raise RuntimeError("kernel exploded")
        return x + x

    def not_supported(self, call: Args) -> list[str]:
        return ["empty input"] if call.args[0].numel() == 0 else []


@pytest.fixture(autouse=True)
def _clean_state() -> None:
    FAKE.reasons = []
    FAKE.raise_at_run_time = False
    reset_state()
    yield
    FAKE.reasons = []
    FAKE.raise_at_run_time = False
    reset_state()


def test_duplicate_name_is_an_error() -> None:
    with pytest.raises(ValueError, match="already registered"):

        @register_op("toy_scale")
        class Again(CustomOp):
            pass


def test_register_requires_customop_and_identifier() -> None:
    with pytest.raises(TypeError):
        register_op("toy_not_op")(nn.Linear)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="identifiers"):
        register_op("bad name")


def test_cpu_path_taken_per_call() -> None:
    op = ToyScale()
    x = torch.ones(3)
    with torch.no_grad():
        assert torch.equal(op(x), x * 2)
    assert op.ran == ["cpu"]


def test_device_without_method_runs_native_not_attributeerror() -> None:
    op = ToyScale()
    with force_device_kind({"cpu": "xpu"}), torch.no_grad():
        assert torch.equal(op(torch.ones(2)), torch.full((2,), 2.0))
    assert op.ran == ["native"]
    decision = explain("toy_scale", ["xpu", "mps", "hip"])
    assert [d.chosen for d in decision] == ["forward_native"] * 3
    assert "no xpu fast path" in decision[0].candidates[0].reasons[0]


def test_redispatch_when_device_changes() -> None:
    op = ToyScale()
    x = torch.ones(2)
    with torch.no_grad():
        op(x)
        with force_device_kind({"cpu": "cuda"}):
            op(x)
        op(x)
    assert op.ran == ["cpu", "cuda", "cpu"]


def test_per_call_reasons_dtype_grad_and_op_specific() -> None:
    op = ToyScale()
    op(torch.ones(2, dtype=torch.float64))  # dtype not accepted
    op(torch.ones(2, requires_grad=True))  # inference only
    with torch.no_grad():
        op(torch.ones(0))  # op-specific reason
        op(torch.ones(2))
    assert op.ran == ["native", "native", "native", "cpu"]
    d = op.explain_call(torch.ones(2, dtype=torch.float64))
    assert d.chosen == "forward_native" and "dtype float64 not supported" in d.candidates[0].reasons
    d = op.explain_call(torch.ones(2, requires_grad=True))
    assert any("grad enabled" in r for r in d.candidates[0].reasons)


def test_disabled_by_config_runs_native() -> None:
    op = ToyScale()
    with torch.no_grad():
        with config.override(custom_ops="none"):
            op(torch.ones(2))
            assert (
                "disabled by DITOPS_CUSTOM_OPS"
                in explain("toy_scale", ["cpu"])[0].candidates[0].reasons[0]
            )
        with config.override(custom_ops="-toy_scale"):
            op(torch.ones(2))
        with config.override(custom_ops="none,+toy_scale"):
            op(torch.ones(2))
    assert op.ran == ["native", "native", "cpu"]


def test_precision_exact_skips_fast_only_paths() -> None:
    op = ToyScale()
    with torch.no_grad(), force_device_kind({"cpu": "cuda"}):
        with config.override(precision="exact"):
            op(torch.ones(2))
        op.precision = "exact"  # a per-module setting wins over the process one
        op(torch.ones(2))
        op.precision = None
        op(torch.ones(2))
    assert op.ran == ["native", "native", "cuda"]
    reasons = explain("toy_scale", ["cuda"], precision="exact")[0].candidates[0].reasons
    assert "does not promise precision='exact'" in reasons[0]


@pytest.mark.parametrize(
    "reason",
    [
        "fakelib is not installed (No module named 'fakelib'); pip install fakelib",
        "fakelib is installed but has no op 'scale' (a build with other op names)",
    ],
)
def test_unusable_backend_falls_back_and_warns_once(
    reason: str, caplog: pytest.LogCaptureFixture, ditops_warnings
) -> None:
    FAKE.reasons = [reason]
    op = ToyScale()
    with torch.no_grad(), force_device_kind({"cpu": "cuda"}), caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert torch.equal(op(torch.ones(2)), torch.full((2,), 2.0))
        ToyScale()(torch.ones(2))  # another instance of the same op: still one warning
    assert op.ran == ["native"] * 3
    warnings = ditops_warnings()
    assert len(warnings) == 1 and reason in warnings[0] and "toy_scale" in warnings[0]
    assert explain("toy_scale", ["cuda"])[0].candidates[0].reasons == [reason]


def test_unusable_backend_raises_in_strict_mode() -> None:
    FAKE.reasons = ["fakelib is not installed; pip install fakelib"]
    op = ToyScale()
    with torch.no_grad(), force_device_kind({"cpu": "cuda"}), config.override(strict=True):
        with pytest.raises(BackendUnavailableError, match="pip install fakelib"):
            op(torch.ones(2))
        # explain reports instead of raising, even in strict mode
        assert explain("toy_scale", ["cuda"])[0].chosen == "forward_native"


def test_kernel_raising_falls_back_for_later_calls_too(
    caplog: pytest.LogCaptureFixture, ditops_warnings
) -> None:
    FAKE.raise_at_run_time = True
    op = ToyScale()
    with torch.no_grad(), force_device_kind({"cpu": "cuda"}), caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert torch.equal(op(torch.ones(2)), torch.full((2,), 2.0))
    # tried once, then native for that call and every later one on that device kind
    assert op.ran == ["cuda", "native", "native", "native"]
    warnings = ditops_warnings()
    assert len(warnings) == 1 and "kernel exploded" in warnings[0]
    reasons = explain("toy_scale", ["cuda"])[0].candidates[0].reasons
    assert any("failed at run time earlier" in r and "kernel exploded" in r for r in reasons)
    # other device kinds are not affected
    with torch.no_grad():
        op(torch.ones(2))
    assert op.ran[-1] == "cpu"


def test_kernel_raising_in_strict_mode_raises_with_cause() -> None:
    FAKE.raise_at_run_time = True
    op = ToyScale()
    with torch.no_grad(), force_device_kind({"cpu": "cuda"}), config.override(strict=True):
        with pytest.raises(BackendUnavailableError, match="kernel exploded") as info:
            op(torch.ones(2))
    assert isinstance(info.value.__cause__, RuntimeError)


@pytest.mark.parametrize("strict", [False, True])
def test_callers_error_is_raised_as_is_and_changes_nothing(
    strict: bool, caplog: pytest.LogCaptureFixture, ditops_warnings
) -> None:
    # Regression: an error the meaning raises too (the caller's) used to give the fast
    # path up for the whole process (and, in strict mode, came back as a misleading
    # BackendUnavailableError).
    op = ToyScale()
    with (
        torch.no_grad(),
        force_device_kind({"cpu": "cuda"}),
        config.override(strict=strict),
        caplog.at_level(logging.WARNING),
    ):
        with pytest.raises(ValueError, match="refuses 7 elements") as info:
            op(torch.ones(7))
        assert info.value.__cause__ is None
        assert torch.equal(op(torch.ones(2)), torch.full((2,), 2.0))
    assert op.ran == ["cuda", "native", "cuda"]
    assert ditops_warnings() == []
    assert explain("toy_scale", ["cuda"])[0].chosen == "forward_cuda"


def test_explain_all_ops_and_bad_arguments() -> None:
    decisions = ditops.explain()
    names = {d.op for d in decisions}
    assert {"fp32_layer_norm", "toy_scale"} <= names
    assert all(d.as_dict()["chosen"].startswith("forward_") for d in decisions)
    with pytest.raises(KeyError, match="no op named"):
        explain("nope")
    with pytest.raises(ValueError, match="precision"):
        explain(precision="fastest")


def test_threads_dispatch_concurrently() -> None:
    op = ToyScale()
    errors: list[BaseException] = []

    def work() -> None:
        try:
            with torch.no_grad():
                for _ in range(50):
                    assert torch.equal(op(torch.ones(4)), torch.full((4,), 2.0))
        except BaseException as exc:  # noqa: BLE001 - surfaced in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and op.ran.count("cpu") == 200


def test_overrides_are_per_thread() -> None:
    # Regression: override() restored a process-wide snapshot, so two threads'
    # interleaved blocks left the wrong setting in force after both had exited.
    before = config.get()
    inside = threading.Barrier(2)
    outside = threading.Barrier(2)
    seen: dict[str, list[str]] = {"exact": [], "fast": []}
    errors: list[BaseException] = []

    def work(precision: str, first_out: bool) -> None:
        try:
            with config.override(precision=precision, strict=True):
                inside.wait(timeout=10)
                seen[precision].append(config.get().precision)
                if not first_out:
                    outside.wait(timeout=10)  # the other thread leaves its block first
            if first_out:
                outside.wait(timeout=10)
            seen[precision].append(config.get().precision)
        except BaseException as exc:  # noqa: BLE001 - surfaced in the main thread
            errors.append(exc)

    threads = [
        threading.Thread(target=work, args=("exact", True)),
        threading.Thread(target=work, args=("fast", False)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert seen["exact"] == ["exact", before.precision]
    assert seen["fast"] == ["fast", before.precision]
    assert config.get() == before


def test_force_device_kind_is_per_thread() -> None:
    seen: list[str] = []
    with force_device_kind({"cpu": "cuda"}):
        t = threading.Thread(target=lambda: seen.append(ditops.device_kind(torch.ones(1))))
        t.start()
        t.join()
        seen.append(ditops.device_kind(torch.ones(1)))
    assert seen == ["cpu", "cuda"]


def test_plan_cache_does_not_grow_with_repeated_overrides() -> None:
    op = ToyScale()
    with torch.no_grad():
        for _ in range(50):
            with config.override(precision="exact"):
                op(torch.ones(2))
            op(torch.ones(2))
    assert len(plan.plans_of(ToyScale)) <= 2  # (cpu, exact) and (cpu, fast)
    assert op.ran == ["cpu"] * 100


# --- ops written for the former core are refused, never half-run --------------------------


@pytest.mark.parametrize("hook", ["fast_path_reasons", "meaning_for_non_finite", "dispatch"])
def test_a_retired_hook_is_refused_when_the_class_is_made(hook: str) -> None:
    with pytest.raises(TypeError, match=f"{hook} is no longer read"):
        type("Old", (CustomOp,), {hook: lambda self, *a: []})


def test_an_alias_of_a_path_is_refused_with_the_declaration_to_write() -> None:
    with pytest.raises(TypeError, match=r"@path\('cuda', \.\.\.\)"):

        class Aliased(CustomOp):
            def forward_native(self, x: torch.Tensor) -> torch.Tensor:
                return x

            @fast_path(backend=FAKE)
            def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
                return x

            forward_hip = forward_cuda


def test_guarded_inputs_need_a_mend_for_the_devices() -> None:
    with pytest.raises(TypeError, match="define mend_non_finite"):

        class Unmended(CustomOp):
            non_finite_inputs = (0,)

            def forward_native(self, x: torch.Tensor) -> torch.Tensor:
                return x

            @fast_path("cuda")
            def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
                return x


def test_one_path_serves_several_kinds_and_is_named_for_each() -> None:
    class Shared(CustomOp):
        def forward_native(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @fast_path("cuda", "hip", "xpu")
        def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
            return x + x

    assert Shared.forward_hip is Shared.forward_cuda and Shared.forward_xpu is Shared.forward_cuda
    op = Shared()
    for kind in ("cuda", "hip", "xpu"):
        with force_device_kind({"cpu": kind}):
            assert op.explain_call(torch.ones(2)).chosen == "forward_cuda"
