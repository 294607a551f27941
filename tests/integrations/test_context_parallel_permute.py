"""The permuted sparse mode (``BlockSparseConfig(permute=True)``) of a patched tiny Wan
under diffusers' context parallelism (Ulysses and Ring, 2 CPU ranks, gloo), against the
same model in one process.

Under context parallelism each rank attends with some of the heads over the whole
sequence (Ulysses' all-to-all, or ditops' exchange under Ring), and the permuted mode
clusters each head on its own: so each rank's permutations (cold at the first sparse
step, warm-started from it at the next), masks and outputs are one process's for its
heads. Asserted: dense step bitwise; at each sparse step the same query and key orders
and the same masks for the rank's heads, outputs within the sparse CP tests' tolerances
(tests/integrations/test_context_parallel.py); in both orders of patching and
``enable_parallelism``. Without the per-head exchange a rank would cluster the tokens of
its shard only: other orders, masks of another shape.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import pytest
import torch
from diffusers import ContextParallelConfig
from torch import nn

import ditops
from tests.integrations.context_parallel_ranks import (
    DTYPES,
    SPARSE,
    TOL,
    diff,
    forward,
    head_slice,
    inputs,
    model_of,
    recorded_masks,
)
from tests.integrations.process_group import run_group

pytestmark = pytest.mark.slow

PERMUTE = dataclasses.replace(SPARSE, permute=True)
MODES = ("ulysses", "ring")
ORDERS = ("patch-enable", "enable-patch")


def permuted_run(model: nn.Module, x: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Step 0 (dense), 1 (sparse, clusters cold) and 2 (warm, other latents: clusters
    move) with masks and orders."""
    layer = model.blocks[0].attn1.processor.sparse
    g = torch.Generator().manual_seed(5)
    moved = torch.randn(x["hidden_states"].shape, generator=g).to(x["hidden_states"].dtype)
    outs, orders = [], []
    with recorded_masks() as masks:
        for step, latents in ((0, None), (1, None), (2, moved)):
            layer._last_permutation = None
            xs = x if latents is None else {**x, "hidden_states": latents}
            outs.append(forward(model, step, xs))
            perm = layer._last_permutation
            if step:
                assert perm is not None, "a sparse step ran without its permutation"
                orders.append((perm.q_order.clone(), perm.k_order.clone()))
    return {"outs": outs, "masks": masks, "orders": orders}


def compare(got: dict[str, Any], want: dict[str, Any], heads: slice) -> dict[str, Any]:
    """The numbers the tests assert on, for the rank's heads."""
    same_masks = len(got["masks"]) == len(want["masks"]) and all(
        torch.equal(g, w[:, heads]) for g, w in zip(got["masks"], want["masks"])
    )
    same_orders = len(got["orders"]) == len(want["orders"]) and all(
        torch.equal(gq, wq[:, heads]) and torch.equal(gk, wk[:, heads])
        for (gq, gk), (wq, wk) in zip(got["orders"], want["orders"])
    )
    return {
        "steps": [diff(g, w) for g, w in zip(got["outs"], want["outs"])],
        "masks_equal": same_masks,
        "mask_calls": len(got["masks"]),
        "orders_equal": same_orders,
        "mask_heads": [int(m.shape[1]) for m in got["masks"]],
    }


@pytest.fixture(scope="module")
def references() -> dict[str, Any]:
    """One process, one thread (as each rank), computed before the fork."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    refs: dict[str, Any] = {}
    try:
        with ditops.override(custom_ops="-block_sparse_attention"):
            for name, dtype in DTYPES.items():
                model = model_of(dtype)
                ditops.patch(model, precision="exact", attention=PERMUTE)
                refs[name] = permuted_run(model, inputs(dtype))
    finally:
        torch.set_num_threads(threads)
    return refs


def rank_checks(refs: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    mine = head_slice(2, rank, world)
    with ditops.override(custom_ops="-block_sparse_attention"):
        for mode in MODES:
            for name, dtype in DTYPES.items():
                for order in ORDERS:
                    model = model_of(dtype)
                    config = ContextParallelConfig(**{f"{mode}_degree": world})
                    if order == "patch-enable":
                        ditops.patch(model, precision="exact", attention=PERMUTE)
                        model.enable_parallelism(config=config)
                    else:
                        model.enable_parallelism(config=config)
                        ditops.patch(model, precision="exact", attention=PERMUTE)
                    got = permuted_run(model, inputs(dtype))
                    out[f"{mode} {name} {order}"] = compare(got, refs[name], mine)
    return out


@pytest.fixture(scope="module")
def ranks(references: dict[str, Any]) -> list[dict[str, Any]]:
    return run_group(functools.partial(rank_checks, references), 2)


def test_the_reference_permutes_and_runs_sparse(references: dict[str, Any]) -> None:
    """The runs compared are the permuted mode's: a non-identity order, sparse masks."""
    for ref in references.values():
        q_order, _ = ref["orders"][0]
        assert not torch.equal(q_order[0, 0], torch.arange(q_order.shape[-1]))
        assert not torch.equal(ref["orders"][1][0], q_order)  # the warm step re-clustered
        assert len(ref["masks"]) == 4  # two sparse steps x two blocks
        assert all(0 < float(m.float().mean()) < 1 for m in ref["masks"])


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("mode", MODES)
def test_permuted_mode_under_context_parallelism_is_one_process(
    ranks: list[dict[str, Any]], mode: str, dtype: str, order: str
) -> None:
    for rank in ranks:
        got = rank[f"{mode} {dtype} {order}"]
        assert got["steps"][0] == 0, got  # dense step: bitwise
        assert max(got["steps"][1:]) <= TOL[dtype], got
        assert got["orders_equal"], got  # cold (step 1) and warm (step 2) clusters
        assert got["masks_equal"] and got["mask_calls"] == 4, got
        assert got["mask_heads"] == [1] * 4, got
