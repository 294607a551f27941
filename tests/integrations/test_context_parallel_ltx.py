"""LTX-Video patched under diffusers' context parallelism (Ulysses, 2 CPU ranks, gloo, fp32).

The exact patch under Ulysses is bitwise the unpatched model under Ulysses, in both orders
(patch then ``enable_parallelism``, and the other way round): the processor hands the
parallel config through to diffusers' attention. With sparse attention, the dense step is
bitwise the unpatched parallel model, and the sparse step (ditops exchanges q/k/v so each
rank attends over the whole sequence for its heads, the first frame's blocks dense from
the grid the model was called with) is within 1e-5 of the same patch in one process.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from diffusers import ContextParallelConfig

import ditops
from ditops.attention.schedule import BlockSparseConfig
from tests.integrations.process_group import run_group
from tests.integrations.test_diffusers_ltx_video import inputs, tiny_ltx

pytestmark = pytest.mark.slow

SPARSE = BlockSparseConfig(sparsity=0.5, skip_first_steps=1, block_size=16, stride=4)
#: the parallel model against one process: other matmul shapes per rank, fp32
TOL = 1e-5


def forward(model: torch.nn.Module, x: dict, step: int) -> torch.Tensor:
    with torch.inference_mode(), model.cache_context("cond", step_index=step):
        return model(**x, return_dict=False)[0]


def diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float("inf") if a.shape != b.shape else float((a.double() - b.double()).abs().max())


def test_ltx_video_under_ulysses() -> None:
    # diffusers 0.42 under Ulysses fails on LTX's text mask ([B, 1, T] against the heads
    # it exchanges) before ditops is involved: no mask here.
    x = {**inputs(torch.float32, frames=4, hw=8), "encoder_attention_mask": None}
    x["encoder_hidden_states"] = torch.randn(1, 8, 12)  # lengths the ranks divide
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # each rank runs one thread; kernels round by thread count
    try:
        one = tiny_ltx(torch.float32)
        ditops.patch(one, precision="exact", attention=SPARSE)
        sparse_ref = forward(one, x, 1)
    finally:
        torch.set_num_threads(threads)

    def checks(rank: int, world: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        plain = tiny_ltx(torch.float32)
        plain.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
        parallel = [forward(plain, x, s) for s in (0, 1)]
        first = tiny_ltx(torch.float32)
        ditops.patch(first, precision="exact")
        first.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
        out["patch-enable"] = diff(forward(first, x, 0), parallel[0])
        second = tiny_ltx(torch.float32)
        second.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
        ditops.patch(second, precision="exact", attention=SPARSE)
        out["sparse dense step"] = diff(forward(second, x, 0), parallel[0])
        sparse = forward(second, x, 1)
        out["sparse step vs one process"] = diff(sparse, sparse_ref)
        out["sparse step vs dense"] = diff(sparse, parallel[1])
        return out

    for rank, got in enumerate(run_group(checks, 2)):
        assert got["patch-enable"] == 0.0, (rank, got)
        assert got["sparse dense step"] == 0.0, (rank, got)
        assert got["sparse step vs one process"] <= TOL, (rank, got)
        assert got["sparse step vs dense"] > TOL, (rank, got)  # it did run sparse
