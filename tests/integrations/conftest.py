"""Fixtures the integration tests share."""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

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


class Kept(NamedTuple):
    """One estimate replaced by :func:`every_block_kept`: the query and key lengths, the
    leading dense blocks asked for, the layout."""

    lq: int
    lk: int
    dense_blocks: int | None
    layout: str


@pytest.fixture
def every_block_kept(monkeypatch: pytest.MonkeyPatch) -> list[Kept]:
    """Block-sparse attention's estimate replaced by one keeping every block (blocks of
    16): the sparse path must then be the dense attention; returns the calls it saw."""
    from ditops.attention.block_mask import num_blocks
    from ditops.layers.sparse_attention import BlockSparseAttention

    seen: list[Kept] = []

    def keep_all(self, q, k, *, layout, scale, dense_blocks=None, **_):
        (b, lq, h, _), lk = q.shape, k.shape[1]
        seen.append(Kept(lq, lk, dense_blocks, layout))
        qb, kb = num_blocks(lq, 16), num_blocks(lk, 16)
        mask = torch.ones(b, h, qb, kb, dtype=torch.int8)
        return mask, torch.full((b, h, qb), kb, dtype=torch.int32)

    monkeypatch.setattr(BlockSparseAttention, "_estimate", keep_all)
    return seen
