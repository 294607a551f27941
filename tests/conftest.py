"""Test-wide set-up.

Triton reads TRITON_INTERPRET when it is first imported, so it is set here, before any
test module can import it: on a machine without a GPU the Triton kernels then run on CPU
tensors through Triton's interpreter (slowly; tests keep their shapes small).
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable, Iterator

os.environ.setdefault("TRITON_INTERPRET", "1")
# Tests assert which path a call takes: the static order, unless a test turns tuning on
# (tests/test_tune.py), and never a tuning cache from the user's home.
os.environ.setdefault("DITOPS_TUNE", "off")
os.environ.setdefault(
    "DITOPS_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"ditops-test-cache-{os.getpid()}")
)

import pytest
import torch


@pytest.fixture
def on_npu() -> Iterator[None]:
    """CPU tensors take the ``npu`` paths. No NPU package is importable (``sgl_kernel_npu``,
    ``attentions``, ``torch_npu``), whatever this machine has, until the test installs
    doubles of them (tests/doubles); backend probes, failures and warnings are forgotten
    before and after."""
    import ditops
    from ditops.custom_op import reset_state
    from tests.doubles.npu_modules import hidden_npu_packages

    reset_state()
    with hidden_npu_packages(), ditops.force_device_kind({"cpu": "npu"}):
        yield
    reset_state()


@pytest.fixture
def ditops_warnings(caplog: pytest.LogCaptureFixture) -> Callable[[], list[str]]:
    """The warnings logged on the ``ditops`` logger so far in the test, as messages."""
    caplog.set_level(logging.WARNING, logger="ditops")

    def messages() -> list[str]:
        return [
            r.getMessage()
            for r in caplog.records
            if r.name == "ditops" and r.levelno == logging.WARNING
        ]

    return messages


@pytest.fixture(autouse=True)
def _seeded_rng() -> None:
    """Each test draws its random inputs from the same seed, whatever ran before it: a
    tolerance test on a few hundred elements is then a fixed case, not a lottery (with
    inputs left to the previous tests' draws, 3 seeds in 2000 put one element more than
    the per-element rate allows into a 960-element fast-path check)."""
    torch.manual_seed(0)


@pytest.fixture(autouse=True, scope="session")
def _no_small_call_rule() -> Iterator[None]:
    """Tests assert which path a call takes on small tensors (their shapes are small so
    Triton's interpreter stays quick): the small-call rule, which runs the meaning for
    calls under ``SMALL_CALL_ELEMENTS`` when tuning is on, is off unless a test turns it
    back on (tests/test_small_calls.py). Session-wide, so that module-scoped fixtures
    (the forwards tests/kernels/test_fake_impls.py records) see it off too."""
    from ditops.core import plan

    saved, plan.SMALL_CALL_ELEMENTS = plan.SMALL_CALL_ELEMENTS, 0
    yield
    plan.SMALL_CALL_ELEMENTS = saved
