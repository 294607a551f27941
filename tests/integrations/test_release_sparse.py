"""Wan's sparse attention as pipelines of every release call the model: in
``cache_context("cond")`` without a step index (diffusers before 0.37 has no
``step_index``), the step counted from the timesteps. ``.ci/releases`` runs it on the
floor, where Wan's own sparse tests (which name the step) cannot run."""

from __future__ import annotations

import torch
from torch import nn

import ditops
from ditops.attention.schedule import BlockSparseConfig
from tests.integrations.test_diffusers_wan import inputs, tiny_wan


def _call(model: nn.Module, x: dict) -> torch.Tensor:
    with torch.inference_mode(), model.cache_context("cond"):
        return model(**x, return_dict=False)[0]


def test_wan_sparse_steps_counted_from_timesteps_dense_step_bitwise() -> None:
    model = tiny_wan(keep_fp32=True)
    x = inputs(frames=4, hw=16)  # 4 x 8 x 8 = 256 tokens
    later = {**x, "timestep": torch.tensor([400])}
    ref, ref_later = _call(model, x), _call(model, later)
    cfg = BlockSparseConfig(sparsity=0.75, skip_first_steps=1, block_size=16, stride=4)
    report = ditops.patch(model, precision="exact", attention=cfg)
    assert report.models["WanTransformer3DModel"]["sparse self-attentions"] == 2
    assert torch.equal(_call(model, x), ref)  # step 0: dense, bitwise
    sparse = _call(model, later)  # step 1 (its timestep is lower): sparse
    assert model._ditops_steps.current() == 1
    assert not torch.equal(sparse, ref_later)
    cos = torch.nn.functional.cosine_similarity(
        sparse.float().flatten(), ref_later.float().flatten(), 0
    )
    assert cos > 0.9, cos
    ditops.unpatch(model)
    assert torch.equal(_call(model, later), ref_later)
