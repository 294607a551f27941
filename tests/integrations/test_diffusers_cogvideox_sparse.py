"""Sparse attention on tiny diffusers CogVideoXTransformer3DModels (1.0 and 1.5): dense
steps bitwise, sparse steps at the density asked (read from the layer) and close to
dense, every block kept = the dense attention, a caller's mask honoured densely."""

from __future__ import annotations

import pytest
import torch

import ditops
from ditops.attention.schedule import BlockSparseConfig
from tests.integrations.test_diffusers_cogvideox import MODEL, TEXT, inputs, run, tiny_cogvideox
from tests.precision import max_rel_err

#: 512 video tokens: 8 token frames of 8 x 8 (1.5 patches 2 latent frames into one). The
#: text and the first frame are dense: 5 of 33 key blocks.
SPARSE_VIDEO = {"v10": dict(frames=8, hw=16), "v15": dict(frames=16, hw=16)}
VIDEO = 512


@pytest.mark.parametrize(("layout", "norms"), [("v10", True), ("v15", True), ("v15", False)])
def test_sparse_density_asked_is_run_and_dense_steps_are_bitwise(
    layout: str, norms: bool, estimates: list
) -> None:
    """As CogVideoXPipeline calls it: guidance batched (batch 2) in
    ``cache_context("cond_uncond")`` without a step index, the step counted from the
    timesteps; sparse from step 1."""
    model = tiny_cogvideox(layout=layout)
    x = inputs(model, batch=2, **SPARSE_VIDEO[layout])
    later = {**x, "timestep": torch.tensor([400] * 2)}
    ref, ref_later = run(model, **x), run(model, **later)
    cfg = BlockSparseConfig(sparsity=0.5, skip_first_steps=1, block_size=16, stride=4)
    report = ditops.patch(model, precision="exact", norms=norms, attention=cfg)
    assert report.models[MODEL]["sparse self-attentions"] == 2
    assert model._ditops_steps.patch_size == ((2, 2, 2) if layout == "v15" else (1, 2, 2))
    assert report.models[MODEL].get("fused blocks", 0) == (2 if norms else 0)
    assert torch.equal(run(model, "cond_uncond", **x), ref)  # step 0: dense, bitwise
    assert estimates == []
    sparse = run(model, "cond_uncond", **later)  # step 1 (its timestep is lower): sparse
    assert model._ditops_steps.current() == 1
    assert len(estimates) == 2 * 2  # every block, every sample
    key_blocks = -(-(VIDEO + TEXT) // 16)
    for block in model.transformer_blocks:  # the density the layer reports: the one asked
        reported = block.attn1.processor.sparse.last_density()
        assert reported.block_density == pytest.approx(0.5, abs=1 / (32 * key_blocks))
    # half the blocks dropped in both blocks: the output's direction (cosine) within 1e-3
    # of dense (measured 1 - 3e-5 for 1.0, 1 - 5e-5 for 1.5); not bitwise, and not an
    # elementwise bound: a dropped block moves a few outputs by a lot, not all of them
    cos = torch.nn.functional.cosine_similarity(
        sparse.float().flatten(), ref_later.float().flatten(), 0
    )
    assert not torch.equal(sparse, ref_later)
    assert cos > 0.999, cos
    assert torch.equal(run(model, "cond_uncond", **x), ref)  # a new pipeline call: dense


@pytest.mark.parametrize("layout", ["v10", "v15"])
def test_sparse_path_with_every_block_kept_is_the_dense_attention(
    every_block_kept: list, layout: str
) -> None:
    """fp32, the estimate replaced by one keeping every block: the split by queries and the
    text keys first give the unpatched model's attention (fp32 attention's tolerance), and
    the leading dense blocks cover the text and the first frame."""
    model = tiny_cogvideox(torch.float32, layout)
    x = inputs(model, **SPARSE_VIDEO[layout])
    ref = run(model, **x)
    ditops.patch(model, precision="exact", attention=BlockSparseConfig(sparsity=0.5, block_size=16))
    out = run(model, "cond", **x)
    assert [kept[:3] for kept in every_block_kept] == [
        (VIDEO, VIDEO + TEXT, -(-(TEXT + 64) // 16))
    ] * 2
    assert max_rel_err(out, ref) < 1e-5


def test_a_call_with_a_mask_runs_dense_on_a_sparse_step(caplog: pytest.LogCaptureFixture) -> None:
    """The model passes no mask; a caller's mask is honoured: diffusers' processor, dense,
    with a warning (block-sparse attention takes no mask)."""
    model = tiny_cogvideox(torch.float32)
    x = inputs(model)
    ditops.patch(model, attention=BlockSparseConfig(sparsity=0.5, block_size=16))
    attn = model.transformer_blocks[0].attn1
    g = torch.Generator().manual_seed(2)
    h, e = torch.randn(1, 64, 32, generator=g), torch.randn(1, TEXT, 32, generator=g)
    mask = torch.ones(1, 64 + TEXT, dtype=torch.bool)
    mask[:, :2] = False
    with ditops.set_step(model, 3), torch.inference_mode():
        got = attn.processor(attn, h, e, mask, x["image_rotary_emb"])
        want = attn.processor.original(attn, h, e, mask, x["image_rotary_emb"])
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert "runs dense attention with the mask on sparse steps" in caplog.text


def test_sparse_under_a_context_parallel_config_is_refused_at_patch() -> None:
    """CogVideoX's processor calls SDPA itself (diffusers gives it no context-parallel
    plan): a processor carrying a parallel config is refused for sparse attention,
    changing nothing; the dense patch is still served."""
    from ditops.integrations import PatchError

    model = tiny_cogvideox()
    for block in model.transformer_blocks:
        block.attn1.processor._parallel_config = object()  # a stand-in
    with pytest.raises(PatchError, match="sparse attention under context parallelism"):
        ditops.patch(model, attention=BlockSparseConfig(sparsity=0.5))
    assert not hasattr(model, "_ditops_patch")
    assert ditops.patch(model).models[MODEL]["fused blocks"] == 2
