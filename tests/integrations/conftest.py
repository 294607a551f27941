"""Fixtures the integration tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from ditops import config
from ditops.custom_op import reset_state


@pytest.fixture
def fresh_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No op planned, no settings read, dynamo reset: as a fresh process starts."""
    reset_state()
    monkeypatch.setattr(config, "_process", None)
    torch._dynamo.reset()
    yield
    reset_state()
