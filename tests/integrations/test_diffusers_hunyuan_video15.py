"""ditops.patch on a tiny diffusers HunyuanVideo15Transformer3DModel built from keyword
arguments: exact precision bitwise (fp32, bf16, fp16; batch 1 and 2; padded text of both
text encoders; t2v and i2v image embeds) with the fused CPU paths shown to run, sparse
attention with the density asked and the text mask kept exactly, refusals."""

from __future__ import annotations

import pytest
import torch
from diffusers import HunyuanVideo15Transformer3DModel
from torch import nn

import ditops
from ditops.attention.schedule import BlockSparseConfig
from ditops.integrations import PatchError
from tests.integrations.family_life import DTYPES
from tests.integrations.spies import HUNYUAN_OPS, cpu_paths_of

TINY = dict(
    in_channels=4,
    out_channels=4,
    num_attention_heads=2,
    attention_head_dim=16,
    num_layers=2,
    num_refiner_layers=1,
    mlp_ratio=2.0,
    patch_size=1,
    patch_size_t=1,
    text_embed_dim=16,
    text_embed_2_dim=8,
    image_embed_dim=8,
    rope_axes_dim=(4, 6, 6),
)


def tiny_model(dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    torch.manual_seed(0)
    return HunyuanVideo15Transformer3DModel(**TINY).to(dtype).eval()


def inputs(
    dtype: torch.dtype = torch.bfloat16,
    batch: int = 1,
    frames: int = 2,
    hw: int = 4,
    i2v: bool = False,
) -> dict:
    """MLLM text (6 tokens, 2 padded; 4 in sample 1), ByT5 text (3, 1 padded), 2 image
    tokens (all zero for t2v: the model masks them)."""
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(batch, 6, dtype=torch.int64)
    mask[:, 4:] = 0
    if batch > 1:
        mask[1, 2:] = 0
    mask_2 = torch.ones(batch, 3, dtype=torch.int64)
    mask_2[:, 2:] = 0
    image = torch.randn(batch, 2, 8, generator=g) if i2v else torch.zeros(batch, 2, 8)
    return {
        "hidden_states": torch.randn(batch, 4, frames, hw, hw, generator=g).to(dtype),
        "timestep": torch.tensor([500] * batch).to(dtype),
        "encoder_hidden_states": torch.randn(batch, 6, 16, generator=g).to(dtype),
        "encoder_attention_mask": mask,
        "encoder_hidden_states_2": torch.randn(batch, 3, 8, generator=g).to(dtype),
        "encoder_attention_mask_2": mask_2,
        "image_embeds": image.to(dtype),
    }


def run(model: nn.Module, name: str | None = None, **kw: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        if name is None:
            return model(**kw, return_dict=False)[0]
        with model.cache_context(name):  # as HunyuanVideo15Pipeline: no step index
            return model(**kw, return_dict=False)[0]


cpu_paths = cpu_paths_of(*HUNYUAN_OPS)  # counts the calls reaching each op's forward_cpu


@pytest.mark.parametrize(
    ("dtype", "batch", "i2v"),
    [
        ("fp32", 1, False),
        ("fp32", 2, True),
        ("bf16", 2, False),
        ("bf16", 2, True),
        ("fp16", 2, True),
    ],
)
def test_exact_patch_is_bitwise_equal_and_unpatch_restores(
    dtype: str, batch: int, i2v: bool, cpu_paths: dict[str, int]
) -> None:
    model = tiny_model(DTYPES[dtype])
    x = inputs(DTYPES[dtype], batch=batch, i2v=i2v)
    ref = run(model, **x)
    report = ditops.patch(model, precision="exact")
    assert report.models["HunyuanVideo15Transformer3DModel"] == {
        "fused blocks": 2,
        "fused attention prologues": 2,
        "fused output norm": 1,
    }
    assert torch.equal(run(model, **x), ref)
    # 2 blocks: 2 modulated norms, 2 residual+norm, 2 residuals, a video prologue and
    # the text's q/k norms each; norm_out
    assert cpu_paths == {
        "adaln_modulate": 2 * 2 + 1,
        "adaln_residual_modulate": 2 * 2,
        "adaln_residual": 2 * 2,
        "qk_norm_rope": 2,
        "rms_norm": 2 * 2,
    }
    ditops.unpatch(model)
    assert "forward" not in vars(model.transformer_blocks[0])
    assert torch.equal(run(model, **x), ref)


SPARSE_VIDEO = dict(frames=8, hw=8)  # 512 video tokens


def test_sparse_density_asked_is_run_and_dense_steps_are_bitwise(estimates: list) -> None:
    model = tiny_model()
    x = inputs(batch=2, **SPARSE_VIDEO)
    later = {**x, "timestep": torch.tensor([400, 400]).bfloat16()}
    ref, ref_later = run(model, **x), run(model, **later)
    cfg = BlockSparseConfig(sparsity=0.5, skip_first_steps=1, block_size=16, stride=4)
    ditops.patch(model, precision="exact", attention=cfg)
    assert torch.equal(run(model, "pred_cond", **x), ref)
    assert estimates == []
    sparse = run(model, "pred_cond", **later)
    assert len(estimates) == 2 * 2  # 2 blocks, 2 samples
    densities = [float(counts.float().mean() / mask.shape[-1]) for mask, counts in estimates]
    assert all(abs(d - 0.5) <= 1 / 33 for d in densities), densities
    cos = torch.nn.functional.cosine_similarity(
        sparse.float().flatten(), ref_later.float().flatten(), 0
    )
    assert not torch.equal(sparse, ref_later) and cos > 0.99, cos


def test_sparse_path_with_every_block_kept_is_the_masked_dense_attention(
    every_block_kept: list,
) -> None:
    """fp32, the estimate replaced by one keeping every block: the padded text left out
    of the video rows' keys, the text rows with their rows of the [N, N] mask, give the
    unpatched model's attention within fp32 attention's tolerance."""
    model = tiny_model(torch.float32)
    x = inputs(torch.float32, batch=2, i2v=True, **SPARSE_VIDEO)
    ref = run(model, **x)
    ditops.patch(model, precision="exact", attention=BlockSparseConfig(sparsity=0.5, block_size=16))
    out = run(model, "pred_cond", **x)
    # kept text keys: 2 image + 2 ByT5 + 4 MLLM tokens (sample 0), + 2 MLLM (sample 1)
    assert [kept.lk - kept.lq for kept in every_block_kept] == [8, 6] * 2
    assert float((out - ref).abs().max() / ref.abs().max()) < 1e-5


def test_a_processor_it_was_not_written_for_is_refused_whole() -> None:
    from diffusers.models.transformers.transformer_hunyuan_video import (
        HunyuanVideoAttnProcessor2_0,
    )

    model = tiny_model()
    model.transformer_blocks[1].attn.set_processor(HunyuanVideoAttnProcessor2_0())
    with pytest.raises(
        PatchError, match=r"transformer_blocks\[1\].attn.processor is a HunyuanVideoAttnProc"
    ):
        ditops.patch(model)
    assert not hasattr(model, "_ditops_patch")
    assert "forward" not in vars(model.transformer_blocks[0])
