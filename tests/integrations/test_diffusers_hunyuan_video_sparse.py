"""Sparse attention on a tiny diffusers HunyuanVideoTransformer3DModel (the model and
inputs of test_diffusers_hunyuan_video.py): dense steps bitwise, sparse steps close with
the density asked, padded text masked exactly, the step counted from the timestep as
HunyuanVideoPipeline gives no step index; refused under context parallelism.
"""

from __future__ import annotations

import pytest
import torch

import ditops
from ditops.attention.schedule import BlockSparseConfig
from ditops.integrations import PatchError
from tests.integrations.test_diffusers_hunyuan_video import inputs, run, tiny_hunyuan
from tests.precision import max_rel_err

SPARSE_VIDEO = dict(frames=8, hw=16)  # 8 frames of 8 x 8 tokens: 512 video tokens


def _densities(calls: list) -> list[float]:
    return [float(counts.float().mean() / mask.shape[-1]) for mask, counts in calls]


@pytest.mark.parametrize(("batch", "norms"), [(1, True), (2, True), (1, False)])
def test_sparse_density_asked_is_run_and_dense_steps_are_bitwise(
    batch: int, norms: bool, estimates: list
) -> None:
    """Sparse from step 1; with ``norms=False`` the sparse steps run diffusers' own q/k
    norms and rotation, dense steps its own processor."""
    model = tiny_hunyuan()
    x = inputs(batch=batch, **SPARSE_VIDEO)
    later = {**x, "timestep": torch.tensor([400] * batch)}
    ref, ref_later = run(model, **x), run(model, **later)
    cfg = BlockSparseConfig(sparsity=0.5, skip_first_steps=1, block_size=16, stride=4)
    report = ditops.patch(model, precision="exact", norms=norms, attention=cfg)
    summary = report.models["HunyuanVideoTransformer3DModel"]
    assert summary["sparse self-attentions"] == 4
    assert summary.get("fused blocks", 0) == (4 if norms else 0)
    assert torch.equal(run(model, "cond", **x), ref)  # step 0: dense, bitwise
    assert estimates == []
    sparse = run(model, "cond", **later)  # step 1 (its timestep is lower): sparse
    assert model._ditops_steps.current() == 1
    assert len(estimates) == 4 * batch  # every block, every sample
    # the density asked, to within one block of a row (33 key blocks)
    assert all(abs(d - 0.5) <= 1 / 33 for d in _densities(estimates)), _densities(estimates)
    assert not torch.equal(sparse, ref_later)
    cos = torch.nn.functional.cosine_similarity(
        sparse.float().flatten(), ref_later.float().flatten(), 0
    )
    assert cos > 0.99, cos
    # the same timestep again: a new pipeline call, step 0, dense
    assert torch.equal(run(model, "cond", **x), ref)


def test_sparse_path_with_every_block_kept_is_the_masked_dense_attention(
    every_block_kept: list,
) -> None:
    """fp32, the estimate replaced by one keeping every block: the split by queries, the
    text keys first and the padded ones left out give the unpatched model's attention
    (within fp32 attention's tolerance); padded text that changes changes nothing."""
    model = tiny_hunyuan(torch.float32)
    x = inputs(torch.float32, batch=2, **SPARSE_VIDEO)
    ref = run(model, **x)
    ditops.patch(model, precision="exact", attention=BlockSparseConfig(sparsity=0.5, block_size=16))
    out = run(model, "cond", **x)
    # per block, sample 0 then 1: 512 video queries over 4 and 2 valid text keys + video
    assert [(kept.lq, kept.lk) for kept in every_block_kept] == [(512, 516), (512, 514)] * 4
    assert {kept.layout for kept in every_block_kept} == {"BSND"}
    assert max_rel_err(out, ref) < 1e-5
    padded = x["encoder_attention_mask"] == 0
    noisy = x["encoder_hidden_states"].masked_fill(padded[..., None], 7.0)
    assert torch.equal(run(model, "cond", **{**x, "encoder_hidden_states": noisy}), out)


def test_steps_counted_per_branch_and_masks_reused(estimates: list) -> None:
    """A loop as HunyuanVideoPipeline's with true CFG: cache_context("cond") then
    ("uncond"), no step index, timesteps falling; estimate_every=2 estimates at sparse
    steps 1 and 3 per branch; a second pipeline call starts again."""
    model = tiny_hunyuan(num_layers=1, num_single_layers=1)
    cfg = BlockSparseConfig(
        sparsity=0.5, skip_first_steps=1, block_size=16, stride=4, estimate_every=2
    )
    ditops.patch(model, attention=cfg)
    x = inputs(frames=4, hw=16)
    steps = model._ditops_steps
    seen = []
    for _call in range(2):
        for i in range(4):
            for name in ("cond", "uncond"):
                before = len(estimates)
                run(model, name, **{**x, "timestep": torch.tensor([900 - 100 * i])})
                seen.append((steps.counted, name, len(estimates) - before))
    one_call = [(i, n, 2 if i in (1, 3) else 0) for i in range(4) for n in ("cond", "uncond")]
    assert seen == one_call * 2


def test_sparse_refuses_a_mask_on_video_keys() -> None:
    from ditops.integrations.hunyuan_video.attention import _text_keys_kept

    mask = torch.ones(1, 1, 1, 10, dtype=torch.bool)
    assert _text_keys_kept(mask, 1, 10, 6, mask.device).shape == (1, 4)
    mask[..., 2] = False
    with pytest.raises(ValueError, match="masks video keys"):
        _text_keys_kept(mask, 1, 10, 6, mask.device)
    with pytest.raises(ValueError, match="boolean key mask"):
        _text_keys_kept(mask.float(), 1, 10, 6, mask.device)


def test_sparse_under_context_parallelism_is_refused_at_patch() -> None:
    """diffusers gives HunyuanVideo no context-parallel plan: sparse attention over
    processors that carry a parallel config is refused when patching (it used to fail at
    the first sparse step), changing nothing; the dense patch is still served."""
    model = tiny_hunyuan()
    for module in model.modules():
        proc = getattr(module, "processor", None)
        if proc is not None and hasattr(proc, "_parallel_config"):
            proc._parallel_config = object()  # a stand-in for what enable_parallelism writes
    with pytest.raises(PatchError, match="sparse attention under context parallelism"):
        ditops.patch(model, attention=BlockSparseConfig(sparsity=0.5))
    assert not hasattr(model, "_ditops_patch")
    assert ditops.patch(model).models["HunyuanVideoTransformer3DModel"]["fused blocks"] == 4
