"""Sparse self-attention of a patched tiny LTXVideoTransformer3DModel (see
test_diffusers_ltx_video.py for the model and its parity tests): dense steps bitwise,
sparse steps at the density asked and close to dense, the first frame's blocks dense from
the grid or the tokens' coordinates, steps counted from the timestep (LTXPipeline gives no
step index) and read by name, copies with their own step state, fullgraph compile.
"""

from __future__ import annotations

import copy
import logging
import pickle

import pytest
import torch
from torch import nn

import ditops
from ditops.attention.schedule import BlockSparseConfig
from tests.integrations.test_diffusers_ltx_video import inputs, run, tiny_ltx

pytest.importorskip("diffusers", reason="the diffusers extra is part of the test install")

# A sparse step drops half the key blocks of every self-attention: on this random tiny
# model (near-uniform attention) the output moves, but stays aligned with dense.
SPARSE_MIN_COSINE = 0.95


@pytest.mark.slow
def test_sparse_compiles_fullgraph_with_a_step_index() -> None:
    """Sparse attention compiled whole (fullgraph, aot_eager) at a sparse step given by
    the step index, the grid recorded by the pre-hook inside the trace: as eager; the
    same without a step index (counted from the timestep, a host read) is refused."""
    torch._dynamo.reset()
    cfg = BlockSparseConfig(sparsity=0.5, skip_first_steps=1, block_size=16, stride=4)
    x = inputs(frames=4, hw=8)
    eager = tiny_ltx(num_layers=1)
    ditops.patch(eager, precision="exact", attention=cfg)
    model = tiny_ltx(num_layers=1)
    ditops.patch(model, precision="exact", attention=cfg)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    try:
        assert torch.equal(run(compiled, step=1, **x), run(eager, step=1, **x))
        with pytest.raises(Exception, match="counts its denoising steps from the timestep"):
            with torch.inference_mode(), model.cache_context("cond_uncond"):
                compiled(**x, return_dict=False)
    finally:
        torch._dynamo.reset()


# --- sparse self-attention ----------------------------------------------------------------------

SPARSE_VIDEO = dict(frames=4, hw=8)  # 4 frames of 8 x 8 tokens: 256, 16 key blocks of 16


def _densities(calls: list) -> list[float]:
    return [float(counts.float().mean() / mask.shape[-1]) for mask, counts in calls]


@pytest.mark.parametrize(("batch", "norms"), [(1, True), (2, True), (1, False)])
def test_sparse_density_asked_is_run_and_dense_steps_are_bitwise(
    batch: int, norms: bool, estimates: list
) -> None:
    """As LTXPipeline calls it (cache_context("cond_uncond") without a step index): step 0
    dense and bitwise, step 1 (a lower timestep) block-sparse at density 0.5 (to within
    one block of a row), close to dense; the same timestep again is a new run, dense."""
    model = tiny_ltx()
    x = inputs(batch=batch, **SPARSE_VIDEO)
    later = {**x, "timestep": torch.tensor([400] * batch)}
    ref, ref_later = run(model, **x), run(model, **later)
    cfg = BlockSparseConfig(sparsity=0.5, skip_first_steps=1, block_size=16, stride=4)
    report = ditops.patch(model, precision="exact", norms=norms, attention=cfg)
    summary = report.models["LTXVideoTransformer3DModel"]
    assert summary["sparse self-attentions"] == 2
    assert summary.get("fused blocks", 0) == (2 if norms else 0)

    def call(kw: dict) -> torch.Tensor:
        with torch.inference_mode(), model.cache_context("cond_uncond"):
            return model(**kw, return_dict=False)[0]

    assert torch.equal(call(x), ref) and estimates == []  # step 0: dense
    sparse = call(later)
    assert model._ditops_steps.current() == 1
    assert len(estimates) == 2  # every block (one estimate for the batch)
    assert all(mask.shape[0] == batch for mask, _ in estimates)
    assert all(abs(d - 0.5) <= 1 / 16 for d in _densities(estimates)), _densities(estimates)
    layer = model.transformer_blocks[0].attn1.processor.sparse
    assert layer.last_density().density == pytest.approx(0.5, abs=1 / 16)
    # the first frame (64 tokens: 4 blocks) dense: its rows and columns all kept
    mask = estimates[0][0]
    assert bool(mask[..., :4, :].all()) and bool(mask[..., :, :4].all())
    assert not torch.equal(sparse, ref_later)
    cos = nn.functional.cosine_similarity(sparse.float().flatten(), ref_later.float().flatten(), 0)
    assert cos > SPARSE_MIN_COSINE, cos
    assert torch.equal(call(x), ref)  # the same timestep again: a new run, step 0, dense
    ditops.unpatch(model)
    assert torch.equal(run(model, **later), ref_later)


def _coords(frames: int, hw: int) -> torch.Tensor:
    grid = torch.meshgrid(*(torch.arange(n) for n in (frames, hw, hw)), indexing="ij")
    return torch.stack(grid, 0).flatten(1)[None].float()


@pytest.mark.parametrize("appended", [0, 16])
def test_sparse_call_with_coordinates_finds_the_grid(
    appended: int,
    estimates: list,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """LTXConditionPipeline gives video_coords, not the grid: read from the coordinates,
    the first frame's blocks dense; with conditioning tokens appended (no grid) the sparse
    step runs without them, at the density asked, and ditops says so."""
    from ditops.integrations.shared import video_sparse

    monkeypatch.setattr(video_sparse, "_WARNED", set())  # said once per process
    model = tiny_ltx()
    x = inputs(**SPARSE_VIDEO)
    del x["num_frames"], x["height"], x["width"]
    x["video_coords"] = _coords(4, 8)
    if appended:
        x["video_coords"] = torch.cat([x["video_coords"], _coords(1, 4)], 2)
        x["hidden_states"] = torch.cat([x["hidden_states"], x["hidden_states"][:, :16]], 1)
    cfg = BlockSparseConfig(sparsity=0.5, block_size=16, stride=4)
    ditops.patch(model, precision="exact", attention=cfg)
    with caplog.at_level(logging.WARNING, logger="ditops"):
        run(model, step=3, **x)
    assert len(estimates) == 2
    assert all(abs(d - 0.5) <= 1 / 16 for d in _densities(estimates))
    assert model._ditops_steps.latent_shape == (1, 0, 4, 8, 8)
    if appended:  # 4 x 8 x 8 is not the 272 tokens: no first frame assumed
        assert "first frame's blocks" in caplog.text
    else:
        assert "first frame's blocks" not in caplog.text
        mask = estimates[0][0]
        assert bool(mask[..., :4, :].all()) and bool(mask[..., :, :4].all())


def test_a_sparse_patched_copy_records_its_own_grid_and_steps() -> None:
    """The grid recorder of a deep copy (and of a pickled model) writes into the copy's
    own step state: the original's stays untouched."""
    model = tiny_ltx()
    ditops.patch(model, precision="exact", attention=BlockSparseConfig(sparsity=0.5))
    twin = copy.deepcopy(model)
    loaded = pickle.loads(pickle.dumps(model))
    for m in (twin, loaded):
        with torch.inference_mode(), m.cache_context("cond_uncond"):
            m(**inputs(frames=3, hw=4), return_dict=False)
        assert m._ditops_steps.latent_shape == (1, 0, 3, 4, 4)
        assert m._ditops_steps.current() == 0
    assert model._ditops_steps.latent_shape is None
    ditops.unpatch(twin)
    assert not twin._forward_pre_hooks


def test_positional_calls_are_read_by_name() -> None:
    """The recorder reads the timestep and the grid by parameter name, positional ones
    too (LTX's timestep is its third argument, not its second as Wan's)."""
    model = tiny_ltx()
    ditops.patch(model, attention=BlockSparseConfig(sparsity=0.5, skip_first_steps=1))
    x = inputs(frames=3)
    args = [
        x[k]
        for k in (
            "hidden_states",
            "encoder_hidden_states",
            "timestep",
            "encoder_attention_mask",
            "num_frames",
            "height",
            "width",
        )
    ]
    with torch.inference_mode():
        for step, t in enumerate((900, 800)):
            with model.cache_context("cond_uncond"):
                model(*args[:2], torch.tensor([t]), *args[3:], return_dict=False)
            assert model._ditops_steps.current() == step
    assert model._ditops_steps.latent_shape == (1, 0, 3, 4, 4)
