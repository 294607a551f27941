"""ditops.patch on a tiny diffusers HunyuanVideoTransformer3DModel built from keyword arguments.

Parity: exact precision is bitwise equal to the unpatched model in fp32, bf16 and fp16,
batch 1 and 2, with padded text (the attention mask) and the guidance embedding, with the
fused CPU paths shown to run (a silent fall back to the eager expressions would be
trivially equal); I2V variants; fast precision within tolerance. Then refusals (changing
nothing) and a patched model's life (tests/integrations/family_life.py's contract).
Sparse attention: test_diffusers_hunyuan_video_sparse.py.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import diffusers
import pytest
import torch
from diffusers import HunyuanVideoTransformer3DModel
from diffusers.models.transformers import transformer_hunyuan_video as hv
from torch import nn

import ditops
from ditops.attention.schedule import BlockSparseConfig
from ditops.integrations import PatchError
from tests.integrations.family_life import (
    DTYPES,
    FamilyContract,
    HookContract,
    Life,
    batches,
    changed,
    refused_whole,
)
from tests.integrations.spies import FLUX_FUSED, HUNYUAN_OPS, cpu_paths_of

FAST_REL_TOL = 2e-2  # as FLUX's: a few ulps of the dtype through 4 blocks

TINY = dict(
    in_channels=4,
    out_channels=4,
    num_attention_heads=2,
    attention_head_dim=16,
    num_layers=2,
    num_single_layers=2,
    num_refiner_layers=1,
    mlp_ratio=2.0,
    patch_size=2,
    patch_size_t=1,
    text_embed_dim=16,
    pooled_projection_dim=8,
    rope_axes_dim=(4, 6, 6),
    guidance_embeds=True,
)
TEXT = 7


def tiny_hunyuan(dtype: torch.dtype = torch.bfloat16, **overrides: object) -> nn.Module:
    torch.manual_seed(0)
    return HunyuanVideoTransformer3DModel(**{**TINY, **overrides}).to(dtype).eval()


def inputs(
    dtype: torch.dtype = torch.bfloat16,
    batch: int = 1,
    frames: int = 2,
    hw: int = 8,
    channels: int = 4,
    guidance: bool = True,
) -> dict:
    """Latents and text; the text is padded (3 of 7 tokens masked, 5 in sample 1)."""
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(batch, TEXT, dtype=torch.int64)
    mask[:, TEXT - 3 :] = 0
    if batch > 1:
        mask[1, 2:] = 0
    x = {
        "hidden_states": torch.randn(batch, channels, frames, hw, hw, generator=g).to(dtype),
        "timestep": torch.tensor([500] * batch),
        "encoder_hidden_states": torch.randn(batch, TEXT, 16, generator=g).to(dtype),
        "encoder_attention_mask": mask,
        "pooled_projections": torch.randn(batch, 8, generator=g).to(dtype),
    }
    if guidance:
        x["guidance"] = torch.tensor([3500.0] * batch).to(dtype)
    return x


def run(model: nn.Module, name: str | None = None, **kw: torch.Tensor) -> torch.Tensor:
    """One call, inside ``cache_context(name)`` without a step index (as the pipeline)."""
    with torch.inference_mode():
        if name is None:
            return model(**kw, return_dict=False)[0]
        with model.cache_context(name):
            return model(**kw, return_dict=False)[0]


cpu_paths = cpu_paths_of(*HUNYUAN_OPS)  # counts the calls reaching each op's forward_cpu


#: per forward of TINY: 2 double blocks (2 modulated norms, 2 residual+norm, 2 residuals,
#: a prologue for the video tokens, q/k norms for the text), 2 single blocks, norm_out.
FUSED_CALLS = {
    "adaln_modulate": 2 * 2 + 2 + 1,
    "adaln_residual_modulate": 2 * 2,
    "adaln_residual": 2 * 2 + 2,
    "qk_norm_rope": 2 + 2,
    "rms_norm": 2 * 2 + 2 * 2,
}


def test_without_guidance_embedding_and_i2v_latent_concat() -> None:
    for overrides, channels in (
        ({"guidance_embeds": False}, 4),
        ({"image_condition_type": "latent_concat", "in_channels": 9}, 9),
    ):
        model = tiny_hunyuan(torch.bfloat16, **overrides)
        x = inputs(channels=channels, guidance=overrides.get("guidance_embeds", True))
        ref = run(model, **x)
        ditops.patch(model, precision="exact")
        assert model._ditops_patch.summary["fused blocks"] == 4
        assert torch.equal(run(model, **x), ref)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_i2v_token_replace_blocks_fused_bitwise(dtype: str, cpu_paths: dict[str, int]) -> None:
    """The first frame's tokens modulated and gated by the token-replace embedding: each
    op on the two row ranges (video and, single-stream, text after the first frame)."""
    model = tiny_hunyuan(DTYPES[dtype], image_condition_type="token_replace")
    x = inputs(DTYPES[dtype], batch=2)
    ref = run(model, **x)
    report = ditops.patch(model, precision="exact")
    assert report.models["HunyuanVideoTransformer3DModel"] == {
        "fused blocks": 4,
        "fused attention prologues": 4,
        "fused output norm": 1,
    }
    assert torch.equal(run(model, **x), ref)
    # double: 2 + 1 (text) of each op; single: 2 modulated norms, 2 residuals; norm_out
    assert cpu_paths == {
        "adaln_modulate": 2 * 3 + 2 * 2 + 1,
        "adaln_residual_modulate": 2 * 3,
        "adaln_residual": 2 * 3 + 2 * 2,
        "qk_norm_rope": 4,
        "rms_norm": 8,
    }


def test_a_hook_added_after_the_patch_is_seen_on_the_next_call() -> None:
    model = tiny_hunyuan()
    x = inputs()
    ditops.patch(model, precision="exact")
    seen: list[int] = []

    def scale(module: nn.Module, args: object, out: torch.Tensor) -> torch.Tensor:
        seen.append(1)
        return out * 2

    plain = tiny_hunyuan()
    plain.transformer_blocks[0].norm2.register_forward_hook(scale)
    plain.single_transformer_blocks[0].attn.norm_q.register_forward_hook(scale)
    ref = run(plain, **x)
    model.transformer_blocks[0].norm2.register_forward_hook(scale)
    model.single_transformer_blocks[0].attn.norm_q.register_forward_hook(scale)
    seen.clear()
    assert torch.equal(run(model, **x), ref)
    assert len(seen) == 2
    places = ditops.explain_patch(model)["HunyuanVideoTransformer3DModel"]
    assert places["transformer_blocks.0"] == "norm2 has a torch forward hook"


def test_an_attention_with_hooks_on_its_q_norm_keeps_diffusers_prologue() -> None:
    model = tiny_hunyuan()
    x = inputs()
    seen: list[int] = []
    model.single_transformer_blocks[0].attn.norm_q.register_forward_hook(lambda *_: seen.append(1))
    ref = run(model, **x)
    report = ditops.patch(model, precision="exact")
    summary = report.models["HunyuanVideoTransformer3DModel"]
    # The prologue's choice is made per call: installed everywhere, skipped while hooked.
    assert summary["fused attention prologues"] == 4 and summary["fused blocks"] == 4
    seen.clear()
    assert torch.equal(run(model, **x), ref)
    assert seen == [1]
    # with sparse attention too, that attention's norms run as diffusers' modules
    ditops.patch(model, attention=BlockSparseConfig(sparsity=0.5, skip_first_steps=1))
    seen.clear()
    assert torch.equal(run(model, **x), ref)
    assert seen == [1]


def test_leaf_level_group_offloading_before_the_patch() -> None:
    """diffusers' leaf-level group offloading hooks every module with weights: the q/k
    norms' hooks keep diffusers' prologue (the fused one would read the weights without
    onloading them); the blocks' norms have no weights, no hooks: they fuse."""
    model = tiny_hunyuan()
    x = inputs(batch=2)
    ref = run(model, **x)
    cpu = torch.device("cpu")
    model.enable_group_offload(onload_device=cpu, offload_device=cpu, offload_type="leaf_level")
    report = ditops.patch(model, precision="exact")
    assert report.models["HunyuanVideoTransformer3DModel"]["fused blocks"] == 4
    assert report.models["HunyuanVideoTransformer3DModel"]["fused output norm"] == 1
    assert torch.equal(run(model, **x), ref)


def _swap_block_class(model: nn.Module) -> None:
    from diffusers.models.transformers.transformer_hunyuan_video import (
        HunyuanVideoTransformerBlock,
    )

    class Copied(HunyuanVideoTransformerBlock):
        # Another forward (a block class is known by the fingerprint of its forward: a
        # subclass that inherits it is the same code and is fused).
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    model.transformer_blocks[1].__class__ = Copied


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (
            _swap_block_class,
            r"transformer_blocks\[1\] is a Copied whose forward \(fingerprint \w+\) is none",
        ),
        (
            lambda m: setattr(
                m.transformer_blocks[0], "norm2", nn.LayerNorm(32, elementwise_affine=True)
            ),
            r"transformer_blocks\[0\].norm2 is not a LayerNorm without affine",
        ),
        (
            lambda m: setattr(m.single_transformer_blocks[1].attn.norm_k, "eps", 1e-5),
            r"single_transformer_blocks\[1\].attn.norm_q/norm_k have different eps",
        ),
        (
            lambda m: m.transformer_blocks[0].attn.set_processor(
                diffusers.models.attention_processor.AttnProcessor2_0()
            ),
            r"transformer_blocks\[0\].attn.processor is a AttnProcessor2_0",
        ),
    ],
    ids=["block_class", "affine_norm", "qk_eps", "processor"],
)
def test_models_it_was_not_written_for_are_refused_whole(change, fragment: str) -> None:
    model = tiny_hunyuan()
    change(model)
    before = [(type(m), vars(m).get("forward")) for m in model.modules()]
    with pytest.raises(PatchError, match=fragment):
        ditops.patch(model, attention=BlockSparseConfig(sparsity=0.5))
    assert not hasattr(model, "_ditops_patch")
    assert [(type(m), vars(m).get("forward")) for m in model.modules()] == before


def test_a_token_replace_norm_it_was_not_written_for_is_refused() -> None:
    from diffusers.models.normalization import FP32LayerNorm

    model = tiny_hunyuan(image_condition_type="token_replace")
    model.transformer_blocks[0].norm1.norm = FP32LayerNorm(32, elementwise_affine=False)
    with pytest.raises(
        PatchError,
        match=r"transformer_blocks\[0\].norm1 is not a HunyuanVideoTokenReplaceAdaLayerNormZero",
    ):
        ditops.patch(model)
    assert not hasattr(model, "_ditops_patch")


LIFE = Life(
    make=tiny_hunyuan,
    inputs=lambda: inputs(batch=2),
    run=run,
    processor=hv.HunyuanVideoAttnProcessor2_0,
    cases=inputs,
)


def test_another_diffusers_version_is_refused_by_fingerprint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A diffusers whose HunyuanVideoAttnProcessor2_0.__call__ differs (its source: the
    fingerprint) is refused, naming it."""
    change = changed(hv.HunyuanVideoAttnProcessor2_0, "__call__")
    fragment = r"HunyuanVideoAttnProcessor2_0.__call__ \(fingerprint"
    refused_whole(LIFE, change, fragment, monkeypatch)


class TestContract(FamilyContract, HookContract):
    """A patched model's life (tests/integrations/family_life.py): deep copies, pickling,
    patching again, compile first (fullgraph, aot_eager) and the Triton paths (fast, the
    GPU code path, diffusers' RMSNorm convention included) with one block of each kind.
    HunyuanVideo serves sparse attention (test_diffusers_hunyuan_video_sparse.py)."""

    test_sparse_attention_is_refused_naming_the_families_that_serve_it = None
    life = LIFE
    hooked = ("transformer_blocks.1.norm2", 3)
    exact_cases = batches(("fp32", 1), ("fp32", 2), ("bf16", 1), ("bf16", 2), ("fp16", 2))
    fused = FLUX_FUSED
    cpu_calls = FUSED_CALLS
    fast_case = {"batch": 2}
    triton_ops = HUNYUAN_OPS
    triton_tolerance = FAST_REL_TOL
    triton_calls = {
        "adaln_modulate": 2 + 1 + 1,
        "adaln_residual_modulate": 2,
        "adaln_residual": 2 + 1,
        "qk_norm_rope": 2,
        "rms_norm": 4,
    }

    def weights(self, model: nn.Module) -> list[torch.Tensor]:
        return [block.attn.norm_q.weight for block in model.transformer_blocks]

    def small(self) -> Life:
        make = functools.partial(tiny_hunyuan, num_layers=1, num_single_layers=1)
        return replace(LIFE, make=make)
