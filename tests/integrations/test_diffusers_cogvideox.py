"""ditops.patch on tiny diffusers CogVideoXTransformer3DModels built from keyword arguments.

Three layouts: CogVideoX 1.0 with rotary tables (5B), 1.0 with sin-cos positions and no
rotary (2B), and 1.5 (``patch_size_t=2``). Parity: exact precision is bitwise equal to
the unpatched model in fp32, bf16 and fp16 with the fused CPU paths counted per forward
(a silent fall back to the eager expressions would be trivially equal), norms with and
without affine parameters; fast precision within tolerance. Sparse attention: dense
steps bitwise, sparse steps at the density asked (read from the layer) and close to
dense, every block kept = the dense attention (test_diffusers_cogvideox_sparse.py).
Then hooks, refusals, a patched model's life (unpatch, deep copy, pickle, torch.compile,
offload: tests/integrations/family_life.py's contract) and the Triton paths.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch
from diffusers import CogVideoXTransformer3DModel
from diffusers.models import attention_processor as ap
from diffusers.models import embeddings, normalization
from diffusers.models.embeddings import get_3d_rotary_pos_embed
from diffusers.models.transformers import cogvideox_transformer_3d
from torch import nn

import ditops
from ditops.attention.schedule import BlockSparseConfig
from ditops.integrations import PatchError
from tests.integrations.family_life import (
    DTYPES,
    FamilyContract,
    Life,
    OffloadContract,
    changed,
    compile_first_fullgraph,
    patched_model_pickles,
    refused_whole,
)
from tests.integrations.spies import cpu_paths_of
from tests.precision import max_rel_err

FAST_REL_TOL = 2e-2  # as FLUX's: a few ulps of the dtype through the blocks

TEXT = 6  # text tokens (the pipeline pads to max_text_seq_length)
TINY = dict(
    num_attention_heads=2,
    attention_head_dim=16,
    in_channels=4,
    out_channels=4,
    time_embed_dim=24,
    text_embed_dim=12,
    num_layers=2,
    sample_width=8,
    sample_height=8,
    sample_frames=9,
    patch_size=2,
    max_text_seq_length=6,
    use_rotary_positional_embeddings=True,
)
LAYOUTS = {
    "v10": {},
    "v10_2b": {"use_rotary_positional_embeddings": False},
    "v15": {"patch_size_t": 2, "ofs_embed_dim": 24},
}
MODEL = "CogVideoXTransformer3DModel"
OPS = (
    "adaln_modulate",
    "adaln_residual",
    "adaln_residual_modulate",
    "layer_norm_scale_shift",
    "scale_residual_layer_norm_scale_shift",
    "rotary_embedding",
)


def tiny_cogvideox(
    dtype: torch.dtype = torch.bfloat16, layout: str = "v10", **overrides: object
) -> nn.Module:
    torch.manual_seed(0)
    model = CogVideoXTransformer3DModel(**{**TINY, **LAYOUTS[layout], **overrides})
    return model.to(dtype).eval()


def inputs(
    model: nn.Module, batch: int = 1, frames: int = 4, hw: int = 8, timestep: int = 500
) -> dict:
    """Latents ``[B, F, C, H, W]``, text, and the rotary tables the pipeline makes."""
    cfg = model.config
    dtype = model.dtype
    g = torch.Generator().manual_seed(1)
    x = {
        "hidden_states": torch.randn(batch, frames, 4, hw, hw, generator=g).to(dtype),
        "encoder_hidden_states": torch.randn(batch, TEXT, 12, generator=g).to(dtype),
        "timestep": torch.tensor([timestep] * batch),
    }
    if cfg.ofs_embed_dim:
        x["ofs"] = torch.tensor([2.0] * batch)
    if cfg.use_rotary_positional_embeddings:
        side = hw // cfg.patch_size
        x["image_rotary_emb"] = get_3d_rotary_pos_embed(
            cfg.attention_head_dim,
            ((0, 0), (side, side)),
            (side, side),
            frames // (cfg.patch_size_t or 1),
        )
    return x


def run(model: nn.Module, name: str | None = None, **kw: torch.Tensor) -> torch.Tensor:
    """One call; inside ``cache_context(name)`` without a step index, as the pipeline."""
    with torch.inference_mode():
        if name is None:
            return model(**kw, return_dict=False)[0]
        with model.cache_context(name):
            return model(**kw, return_dict=False)[0]


cpu_paths = cpu_paths_of(*OPS)  # counts the calls reaching each op's forward_cpu


def fused_calls(dtype: str, affine: bool, rotary: bool) -> dict[str, int]:
    """Per forward of 2 blocks and the output norm (see cogvideox.family): residuals on
    adaln_residual; affine norms on the fp32 chain in fp32 (in bf16/fp16 exact, diffusers'
    expression); norms without affine on the model-dtype ops; rotary for q and k."""
    calls = {"rotary_embedding": 2 * 2} if rotary else {}
    if not affine:
        return {
            **calls,
            "adaln_modulate": 2 * 2 + 1,
            "adaln_residual_modulate": 2 * 2,
            "adaln_residual": 2 * 2,
        }
    if dtype == "fp32":
        chain = {"layer_norm_scale_shift": 2 * 2 + 1, "scale_residual_layer_norm_scale_shift": 4}
        return {**calls, **chain, "adaln_residual": 2 * 2}
    return {**calls, "adaln_residual": 2 * 2 * 2}


@pytest.mark.parametrize(
    ("layout", "dtype", "batch"),
    [
        ("v10", "fp32", 1),
        ("v10", "bf16", 2),
        ("v10", "fp16", 2),
        ("v15", "fp32", 2),
        ("v15", "bf16", 1),
        ("v15", "fp16", 1),
        ("v10_2b", "fp16", 2),
        ("v10_2b", "fp32", 1),
    ],
)
def test_exact_patch_is_bitwise_equal_and_unpatch_restores(
    layout: str, dtype: str, batch: int, cpu_paths: dict[str, int]
) -> None:
    model = tiny_cogvideox(DTYPES[dtype], layout)
    x = inputs(model, batch=batch)
    ref = run(model, **x)
    report = ditops.patch(model, precision="exact")
    # the 2B layout has no rotary tables: nothing to fuse in its prologue, so its
    # processors stay diffusers' and the report says so (not "fused")
    prologues = (
        {"attention processors kept": 2} if layout == "v10_2b" else {"fused attention prologues": 2}
    )
    assert report.models[MODEL] == {"fused blocks": 2, **prologues, "fused output norm": 1}
    assert torch.equal(run(model, **x), ref)
    assert cpu_paths == fused_calls(dtype, affine=True, rotary=layout != "v10_2b")
    ditops.unpatch(model)
    assert "forward" not in vars(model.transformer_blocks[0])
    assert type(model.transformer_blocks[0].attn1.processor).__name__ == (
        "CogVideoXAttnProcessor2_0"
    )
    assert torch.equal(run(model, **x), ref)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_norms_without_affine_go_on_the_model_dtype_ops_bitwise(
    dtype: str, cpu_paths: dict[str, int]
) -> None:
    model = tiny_cogvideox(DTYPES[dtype], "v15", norm_elementwise_affine=False)
    x = inputs(model, batch=2)
    ref = run(model, **x)
    ditops.patch(model, precision="exact")
    assert torch.equal(run(model, **x), ref)
    assert cpu_paths == fused_calls(dtype, affine=False, rotary=True)


@pytest.mark.parametrize(("layout", "dtype"), [(lay, d) for lay in ("v10", "v15") for d in DTYPES])
def test_fast_patch_within_tolerance(layout: str, dtype: str) -> None:
    model = tiny_cogvideox(DTYPES[dtype], layout)
    x = inputs(model, batch=2)
    ref = run(model, **x)
    ditops.patch(model, precision="fast")
    out = run(model, **x)
    assert out.dtype == ref.dtype
    assert max_rel_err(out, ref) <= FAST_REL_TOL


def test_a_block_with_a_hook_on_a_bypassed_norm_runs_unfused_bitwise() -> None:
    model = tiny_cogvideox()
    x = inputs(model)
    seen: list[int] = []
    model.transformer_blocks[1].norm2.norm.register_forward_hook(lambda *_: seen.append(1))
    ref = run(model, **x)
    report = ditops.patch(model, precision="exact")
    assert report.models[MODEL]["fused blocks"] == 1
    assert report.models[MODEL]["unfused blocks"] == 1
    why = report.unfused[MODEL]["transformer_blocks.1"]
    assert "norm2.norm has a torch forward hook" in why
    seen.clear()
    assert torch.equal(run(model, **x), ref)
    assert seen == [1, 1]  # the hook still runs (for the video rows and the text rows)


def test_first_block_cache_in_both_orders() -> None:
    from diffusers import FirstBlockCacheConfig

    def steps(model: nn.Module, x: dict) -> list[torch.Tensor]:
        model._diffusers_hook.reset_stateful_hooks()
        with torch.inference_mode():
            outs = []
            for i in range(3):
                with model.cache_context("cond", step_index=i):
                    t = torch.tensor([900 - i])
                    outs.append(model(**{**x, "timestep": t}, return_dict=False)[0])
        return outs

    cache = FirstBlockCacheConfig(threshold=0.2)
    plain = tiny_cogvideox()
    x = inputs(plain)
    plain.enable_cache(cache)
    want = steps(plain, x)
    patch_first = tiny_cogvideox()
    ditops.patch(patch_first, precision="exact")
    patch_first.enable_cache(cache)
    assert all(torch.equal(a, b) for a, b in zip(steps(patch_first, x), want))
    hook_first = tiny_cogvideox()
    hook_first.enable_cache(cache)
    ditops.patch(hook_first, precision="exact")
    assert all(torch.equal(a, b) for a, b in zip(steps(hook_first, x), want))


def test_a_norm_of_the_users_leaves_its_block_unfused() -> None:
    class MyLayerNorm(nn.LayerNorm):
        pass

    model = tiny_cogvideox()
    model.transformer_blocks[0].norm1.norm = MyLayerNorm(32).bfloat16()
    x = inputs(model)
    ref = run(model, **x)
    report = ditops.patch(model, precision="exact")
    why = report.unfused[MODEL]["transformer_blocks.0"]
    assert "norm1.norm is a MyLayerNorm, not an nn.LayerNorm" in why
    assert torch.equal(run(model, **x), ref)


LIFE = Life(
    make=tiny_cogvideox,
    inputs=lambda: inputs(tiny_cogvideox(), batch=2),
    run=run,
    attn="attn1",
    processor=ap.CogVideoXAttnProcessor2_0,
)


def life_of(dtype: torch.dtype, layout: str, **overrides: object) -> Life:
    make = functools.partial(tiny_cogvideox, dtype, layout, **overrides)
    return replace(LIFE, make=make, inputs=lambda: inputs(make(), batch=2))


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (
            changed(normalization.CogVideoXLayerNormZero, "forward"),
            r"CogVideoXLayerNormZero.forward of diffusers .* differs",
        ),
        (
            changed(cogvideox_transformer_3d.CogVideoXBlock, "forward"),
            r"transformer_blocks\[0\] is a CogVideoXBlock whose forward .* none ditops knows",
        ),
        (
            changed(ap.CogVideoXAttnProcessor2_0, "__call__"),
            r"attn1.processor CogVideoXAttnProcessor2_0.__call__ .* differs",
        ),
        (changed(embeddings, "apply_rotary_emb"), r"apply_rotary_emb of diffusers .* differs"),
    ],
    ids=["norm", "block", "processor", "rotary"],
)
def test_a_changed_diffusers_forward_is_refused_changing_nothing(
    change, fragment: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    refused_whole(LIFE, change, fragment, monkeypatch, attention=BlockSparseConfig(sparsity=0.5))


def test_diffusers_fused_qkv_processor_is_kept_and_refused_for_sparse() -> None:
    model = tiny_cogvideox(torch.float32)
    x = inputs(model)
    model.fuse_qkv_projections()
    ref = run(model, **x)
    report = ditops.patch(model, precision="exact")
    assert report.models[MODEL]["attention processors kept"] == 2
    assert torch.equal(run(model, **x), ref)
    with pytest.raises(PatchError, match="FusedCogVideoXAttnProcessor2_0, not"):
        ditops.patch(model, attention=BlockSparseConfig(sparsity=0.5))


def test_patched_model_pickles_in_fp32() -> None:
    """The contract's pickling in fp32 (its model is bf16)."""
    patched_model_pickles(life_of(torch.float32, "v10"))


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_process")
def test_compile_first_fullgraph_without_recompiles_v10() -> None:
    """fp32: the fp32 chain's ops (the contract's compile runs 1.5)."""
    compile_first_fullgraph(life_of(torch.float32, "v10", num_layers=1))


@pytest.mark.slow
def test_compiled_fast_bf16_is_the_eager_patched_model() -> None:
    """fullgraph, aot_eager: in bf16 the chain chosen from the precision in force (fast:
    the fp32 ops), traced; the same bits as the eager patched model."""
    torch._dynamo.reset()
    model = tiny_cogvideox(torch.bfloat16, "v15", num_layers=1)
    x = inputs(model)
    ref = run(model, **x)
    ditops.patch(model, precision="fast")
    eager = run(model, **x)
    assert not torch.equal(eager, ref)  # fast rounds once where eager rounds four times
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    try:
        assert torch.equal(run(compiled, **x), eager)
    finally:
        torch._dynamo.reset()


class TestContract(FamilyContract, OffloadContract):
    """A patched model's life (tests/integrations/family_life.py): deep copies, pickling,
    patching again, compile first (1.5, fp32: the fp32 chain's ops), the Triton paths
    (1.5, fast, bf16; attention itself runs diffusers' SDPA), offload in both orders.
    CogVideoX serves sparse attention (test_diffusers_cogvideox_sparse.py)."""

    test_sparse_attention_is_refused_naming_the_families_that_serve_it = None
    # its parity tests are its own (three layouts; the ops each dtype takes differ)
    test_exact_patch_is_bitwise_equal_and_unpatch_restores = None
    test_fast_patch_within_tolerance = None
    life = LIFE
    triton_ops = (
        "layer_norm_scale_shift",
        "scale_residual_layer_norm_scale_shift",
        "adaln_residual",
        "rotary_embedding",
    )
    triton_tolerance = FAST_REL_TOL
    triton_calls = {
        "layer_norm_scale_shift": 3,
        "scale_residual_layer_norm_scale_shift": 2,
        "adaln_residual": 2,
        "rotary_embedding": 2,
    }

    def weights(self, model: nn.Module) -> list[torch.Tensor]:
        return [block.norm1.norm.weight for block in model.transformer_blocks]

    def small(self) -> Life:
        return life_of(torch.bfloat16, "v15", num_layers=1)

    def compiled(self) -> Life:
        return life_of(torch.float32, "v15", num_layers=1)

    def offloaded(self, places: dict[str, str], mode: str) -> None:
        """CogVideoX's LayerNorms hold weights: sequential and leaf-level offload hook
        them, so the blocks and the output norm run diffusers' forward (the guard),
        saying why."""
        assert places.pop("").startswith("diffusers ")  # the model's line: arithmetic matched
        assert set(places) == {"transformer_blocks.0", "transformer_blocks.1", "norm_out"}
        if mode in ("model", "group-block"):
            assert set(places.values()) == {"fused"}, places
        else:
            hook = "an accelerate hook" if mode == "sequential" else "diffusers hooks"
            assert all(hook in why for why in places.values()), places
