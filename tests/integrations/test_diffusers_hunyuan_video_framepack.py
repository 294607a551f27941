"""ditops.patch on a tiny diffusers HunyuanVideoFramepackTransformer3DModel (built from
keyword arguments): HunyuanVideo's blocks and processor, so the family is HunyuanVideo's
declaration under another model class. Exact precision bitwise with the fused ops shown to
run, batch 1 (no mask: the model trims the text) and 2 (the key mask); sparse attention
with the history and clean latents (the rows before the generated video) and the first
generated frame dense, at the density asked; unpatch restores.
"""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import HunyuanVideoFramepackTransformer3DModel
from torch import nn

import ditops
from ditops.attention.schedule import BlockSparseConfig
from tests.integrations import test_diffusers_hunyuan_video as hv
from tests.integrations.spies import HUNYUAN_OPS, cpu_paths_of

#: HunyuanVideo's tiny model (test_diffusers_hunyuan_video.py) with Framepack's parts.
TINY = dict(hv.TINY, has_image_proj=True, image_proj_dim=12, has_clean_x_embedder=True)
TEXT, IMAGE = 7, 3
NAME = "HunyuanVideoFramepackTransformer3DModel"

cpu_paths = cpu_paths_of(*HUNYUAN_OPS)


def tiny(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return HunyuanVideoFramepackTransformer3DModel(**TINY).to(dtype).eval()


def inputs(
    dtype: torch.dtype = torch.float32, batch: int = 1, frames: int = 2, hw: int = 8, t: int = 500
) -> dict:
    """Noisy latents with one clean frame, two 2x and four 4x history frames; padded text."""
    g = torch.Generator().manual_seed(1)

    def latents(n: int) -> torch.Tensor:
        return torch.randn(batch, 4, n, hw, hw, generator=g).to(dtype)

    def indices(start: int, n: int) -> torch.Tensor:
        return torch.arange(start, start + n)  # one set for the batch, as the rope takes

    mask = torch.ones(batch, TEXT, dtype=torch.int64)
    mask[:, TEXT - 2 :] = 0
    if batch > 1:
        mask[1, 3:] = 0
    return {
        "hidden_states": latents(frames),
        "timestep": torch.tensor([t] * batch),
        "encoder_hidden_states": torch.randn(batch, TEXT, 16, generator=g).to(dtype),
        "encoder_attention_mask": mask,
        "pooled_projections": torch.randn(batch, 8, generator=g).to(dtype),
        "image_embeds": torch.randn(batch, IMAGE, 12, generator=g).to(dtype),
        "indices_latents": indices(7, frames),
        "guidance": torch.tensor([3500.0] * batch).to(dtype),
        "latents_clean": latents(1),
        "indices_latents_clean": indices(0, 1),
        "latents_history_2x": latents(2),
        "indices_latents_history_2x": indices(1, 2),
        "latents_history_4x": latents(4),
        "indices_latents_history_4x": indices(3, 4),
    }


def run(model: nn.Module, name: str | None = None, **kw: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        if name is None:
            return model(**kw, return_dict=False)[0]
        with model.cache_context(name):
            return model(**kw, return_dict=False)[0]


@pytest.mark.parametrize(
    ("dtype", "batch"), [(torch.float32, 1), (torch.float32, 2), (torch.bfloat16, 2)]
)
def test_exact_patch_is_bitwise_and_unpatch_restores(
    dtype: torch.dtype, batch: int, cpu_paths: dict[str, int]
) -> None:
    model = tiny(dtype)
    x = inputs(dtype, batch)
    ref = run(model, **x)
    report = ditops.patch(model, precision="exact")
    assert report.models[NAME] == {
        "fused blocks": 4,
        "fused attention prologues": 4,
        "fused output norm": 1,
    }
    assert torch.equal(run(model, **x), ref)
    # per forward: 2 double blocks (2 modulated norms, 2 residual + norm, 2 residuals, a
    # video prologue, text q/k norms), 2 single blocks, the output norm
    assert cpu_paths == {
        "adaln_modulate": 2 * 2 + 2 + 1,
        "adaln_residual_modulate": 2 * 2,
        "adaln_residual": 2 * 2 + 2,
        "qk_norm_rope": 2 + 2,
        "rms_norm": 2 * 2 + 2 * 2,
    }
    ditops.unpatch(model)
    assert "forward" not in vars(model.transformer_blocks[0])
    assert torch.equal(run(model, **x), ref)


@pytest.mark.parametrize("batch", [1, 2])
def test_sparse_keeps_the_history_dense_at_the_density_asked(
    batch: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sparse from step 1: every row before the generated video (history and clean
    latents: 64 + 16 + 4 tokens) and the first generated frame (64) lead the dense blocks,
    with the kept text keys; the estimate runs at the density asked."""
    from ditops.layers.sparse_attention import BlockSparseAttention
    from ditops.ops.estimate_block_mask import estimate_block_mask

    leads: list[int] = []
    original = BlockSparseAttention.forward

    def spy(self, q, k, v, **kw):
        leads.append(kw["dense_blocks"])
        return original(self, q, k, v, **kw)

    monkeypatch.setattr(BlockSparseAttention, "forward", spy)
    estimates: list = []
    hook = estimate_block_mask.op.register_forward_hook(lambda _m, _a, out: estimates.append(out))
    try:
        model = tiny()
        x = inputs(batch=batch, frames=8, hw=16)
        later = {**x, "timestep": torch.tensor([400] * batch)}
        ref, ref_later = run(model, **x), run(model, **later)
        cfg = BlockSparseConfig(sparsity=0.5, skip_first_steps=1, block_size=16)
        ditops.patch(model, precision="exact", attention=cfg)
        assert torch.equal(run(model, "cond", **x), ref)  # step 0: dense, bitwise
        assert leads == []
        sparse = run(model, "cond", **later)
    finally:
        hook.remove()
    kept_text = [IMAGE + TEXT - 2, IMAGE + 3][:batch] if batch > 1 else [IMAGE + TEXT - 2]
    context, frame = 64 + 16 + 4, 64
    expected = [math.ceil((t + context + frame) / 16) for t in kept_text] * 4
    assert leads == expected
    densities = [float(c.float().mean() / m.shape[-1]) for m, c in estimates]
    blocks = math.ceil((kept_text[0] + context + 8 * 64) / 16)
    assert all(abs(d - 0.5) <= 1 / blocks for d in densities), densities
    cos = torch.nn.functional.cosine_similarity(
        sparse.float().flatten(), ref_later.float().flatten(), 0
    )
    assert not torch.equal(sparse, ref_later) and cos > 0.99, cos
