"""Fixtures the integration tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from ditops import config
from ditops.custom_op import reset_state
from tests.integrations.family_life import generate_cases


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    generate_cases(metafunc)


@pytest.fixture
def fresh_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No op planned, no settings read, dynamo reset: as a fresh process starts."""
    reset_state()
    monkeypatch.setattr(config, "_process", None)
    torch._dynamo.reset()
    yield
    reset_state()


@pytest.fixture
def estimates() -> Iterator[list]:
    """The outputs of every ``estimate_block_mask`` call (a mask and its counts) while the
    test runs: how many sparse estimates ran, and at which density."""
    from ditops.ops.estimate_block_mask import estimate_block_mask

    calls: list = []
    hook = estimate_block_mask.op.register_forward_hook(lambda _m, _a, out: calls.append(out))
    yield calls
    hook.remove()
