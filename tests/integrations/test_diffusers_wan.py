"""ditops.patch on tiny diffusers models built from keyword arguments (no downloads).

Parity: exact precision is bitwise equal to the unpatched model (both with
``model.to(bf16)``, which also casts the modules diffusers keeps in fp32, and with those
kept in fp32 as ``from_pretrained(torch_dtype=...)`` does); fast precision is within the
stated tolerance; sparse attention at sparsity 0 or before ``skip_first_steps`` equals
dense; unpatch restores outputs bitwise.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import WanTransformer3DModel
from torch import nn

import ditops
from ditops.attention.schedule import BlockSparseConfig
from ditops.bench.wan_model import cast_like_from_pretrained
from ditops.integrations import PatchError, set_step
from ditops.integrations.shared.undo import ClassSwap
from ditops.layers.norm import FP32LayerNorm
from tests.integrations.spies import WAN_OPS, cpu_paths_of

# fast precision: the patched model's output against the unpatched one, relative to the
# output's scale (bf16 activations through 2 blocks: a few bf16 ulps).
FAST_REL_TOL = 2e-2

TINY = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=16,
    in_channels=4,
    out_channels=4,
    text_dim=16,
    freq_dim=16,
    ffn_dim=48,
    num_layers=2,
    cross_attn_norm=True,
    rope_max_seq_len=64,
)


def tiny_wan(keep_fp32: bool, **overrides: object) -> WanTransformer3DModel:
    torch.manual_seed(0)
    model = WanTransformer3DModel(**{**TINY, **overrides}).eval()
    if keep_fp32:
        # What from_pretrained(torch_dtype=bf16) does: _keep_in_fp32_modules stay fp32.
        return cast_like_from_pretrained(model, torch.bfloat16)
    return model.to(torch.bfloat16)


def inputs(frames: int = 2, hw: int = 8, per_token: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(1, 4, frames, hw, hw, generator=g).bfloat16()
    t = torch.tensor([500])
    if per_token:  # Wan2.2 TI2V: a timestep per token
        t = torch.randint(0, 1000, (1, frames * (hw // 2) ** 2), generator=g)
    text = torch.randn(1, 7, 16, generator=g).bfloat16()
    return {"hidden_states": latents, "timestep": t, "encoder_hidden_states": text}


def run(model: nn.Module, step: int | None = None, **kw: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        if step is None:
            return model(**kw, return_dict=False)[0]
        with model.cache_context("cond", step_index=step):
            return model(**kw, return_dict=False)[0]


cpu_paths = cpu_paths_of(*WAN_OPS)  # counts the calls reaching each op's forward_cpu


@pytest.mark.parametrize("keep_fp32", [False, True], ids=["to_bf16", "fp32_modules"])
@pytest.mark.parametrize("per_token", [False, True], ids=["per_sample", "per_token"])
def test_exact_patch_is_bitwise_equal_and_unpatch_restores(
    keep_fp32: bool, per_token: bool, cpu_paths: dict[str, int]
) -> None:
    model = tiny_wan(keep_fp32)
    x = inputs(per_token=per_token)
    ref = run(model, **x)
    report = ditops.patch(model, precision="exact")
    assert report.models["WanTransformer3DModel"]["fused blocks"] == 2
    assert isinstance(model.blocks[0].norm2, FP32LayerNorm) and isinstance(
        model.norm_out, FP32LayerNorm
    )
    out = run(model, **x)
    assert torch.equal(out, ref)
    # the fused CPU paths ran (2 blocks): not a silent fall back to the eager expressions
    assert cpu_paths == {
        "layer_norm_scale_shift": 2,
        "scale_residual_layer_norm_scale_shift": 4,
        "gated_residual": 2,
        "fp32_layer_norm": 1,
        "qk_norm_rope": 2,
    }
    assert report.models["WanTransformer3DModel"]["fused attention prologues"] == 2
    ditops.unpatch(model)
    assert type(model.blocks[0].attn1.processor).__name__ == "WanAttnProcessor"
    assert type(model.blocks[0].norm2).__name__ == "FP32LayerNorm" and not isinstance(
        model.blocks[0].norm2, FP32LayerNorm
    )
    assert "forward" not in vars(model.blocks[0])
    assert torch.equal(run(model, **x), ref)


def test_exact_patch_in_fp32_is_bitwise_equal(cpu_paths: dict[str, int]) -> None:
    torch.manual_seed(0)
    model = WanTransformer3DModel(**TINY).eval()
    x = {k: v.float() if v.is_floating_point() else v for k, v in inputs().items()}
    ref = run(model, **x)
    ditops.patch(model, precision="exact")
    assert torch.equal(run(model, **x), ref)
    assert cpu_paths["qk_norm_rope"] == 2 and cpu_paths["layer_norm_scale_shift"] == 2


def test_fast_patch_within_tolerance() -> None:
    model = tiny_wan(keep_fp32=True)
    x = inputs()
    ref = run(model, **x).float()
    ditops.patch(model, precision="fast")
    out = run(model, **x).float()
    rel = (out - ref).abs().max() / ref.abs().max()
    assert rel <= FAST_REL_TOL, rel


def test_no_cross_attn_norm() -> None:
    model = tiny_wan(keep_fp32=False, cross_attn_norm=False)  # norm2 is nn.Identity
    x = inputs()
    ref = run(model, **x)
    ditops.patch(model, precision="exact")
    assert torch.equal(run(model, **x), ref)


@pytest.mark.parametrize("keep_fp32", [False, True], ids=["to_bf16", "fp32_modules"])
def test_i2v_with_image_keys_and_values(keep_fp32: bool) -> None:
    # Wan I2V: an image embedder (with its own FP32LayerNorms) and added k/v projections
    # in cross-attention; diffusers' processor takes all but the last 512 context tokens
    # as the image's.
    model = tiny_wan(keep_fp32, image_dim=8, added_kv_proj_dim=32)
    x = inputs()
    g = torch.Generator().manual_seed(2)
    x["encoder_hidden_states"] = torch.randn(1, 512, 16, generator=g).bfloat16()
    x["encoder_hidden_states_image"] = torch.randn(1, 5, 8, generator=g).bfloat16()
    ref = run(model, **x)
    report = ditops.patch(
        model, precision="exact", attention=BlockSparseConfig(sparsity=0.0, block_size=32, stride=4)
    )
    assert report.models["WanTransformer3DModel"]["norms"] >= 8  # blocks, output, image embedder
    assert torch.equal(run(model, step=0, **x), ref)
    ditops.unpatch(model)
    assert torch.equal(run(model, **x), ref)


def test_patch_twice_is_harmless_and_other_options_repatch() -> None:
    model = tiny_wan(keep_fp32=False)
    x = inputs()
    ref = run(model, **x)
    first = ditops.patch(model, precision="exact")
    again = ditops.patch(model, precision="exact")
    assert first.models == again.models
    assert isinstance(model.blocks[0].norm1, FP32LayerNorm)
    swaps = [c for c in model._ditops_patch.changes if isinstance(c, ClassSwap)]
    assert len(swaps) == first.models["WanTransformer3DModel"]["norms"]
    ditops.patch(model, precision="fast")
    assert model.blocks[0].norm1.precision == "fast"
    ditops.unpatch(model)
    ditops.unpatch(model)  # a no-op
    assert torch.equal(run(model, **x), ref)


def test_sparse_at_sparsity_zero_and_before_skip_equals_dense() -> None:
    model = tiny_wan(keep_fp32=False)
    x = inputs(frames=4, hw=16)  # 4 x 8 x 8 = 256 tokens
    refs = [run(model, step=i, **x) for i in range(2)]
    ditops.patch(
        model, precision="exact", attention=BlockSparseConfig(sparsity=0.0, block_size=32, stride=4)
    )
    assert all(torch.equal(run(model, step=i, **x), refs[i]) for i in range(2))
    # Blocks of 16: rows of 16 candidates, so the top-k cap leaves blocks out (with 8,
    # the forced first frame, sink and recent blocks keep them all: the same as dense).
    cfg = BlockSparseConfig(sparsity=0.75, skip_first_steps=1, block_size=16, stride=4)
    ditops.patch(model, precision="exact", attention=cfg)
    assert torch.equal(run(model, step=0, **x), refs[0])  # dense step
    sparse = run(model, step=1, **x)  # sparse step: close, not equal
    assert not torch.equal(sparse, refs[1])
    cos = torch.nn.functional.cosine_similarity(
        sparse.float().flatten(), refs[1].float().flatten(), 0
    )
    assert cos > 0.9, cos
    # unknown step with skip_first_steps > 0: dense, never sparse by accident
    assert torch.equal(run(model, **x), refs[0])
    set_step(model, 0)
    assert torch.equal(run(model, **x), refs[0])
    set_step(model, None)
    ditops.unpatch(model)
    assert torch.equal(run(model, step=1, **x), refs[1])


def test_step_index_is_shared_by_cfg_calls_and_reset_per_pipeline_call() -> None:
    model = tiny_wan(keep_fp32=False)
    x = inputs(frames=4, hw=16)
    cfg = BlockSparseConfig(sparsity=0.5, skip_first_steps=1, block_size=32, stride=4)
    ditops.patch(model, attention=cfg)
    seen = []
    proc = model.blocks[0].attn1.processor
    original_dense_now = proc._dense_now
    proc._dense_now = lambda: seen.append(proc.steps.current()) or original_dense_now()
    for step in (0, 1):  # one "pipeline call", two guidance calls per step
        for name in ("cond", "uncond"):
            with torch.inference_mode(), model.cache_context(name, step_index=step):
                model(**x, return_dict=False)
    for step in (0,):  # the next pipeline call starts again at 0
        with torch.inference_mode(), model.cache_context("cond", step_index=step):
            model(**x, return_dict=False)
    assert seen == [0, 0, 1, 1, 0]


def test_masks_reused_per_layer_and_guidance_branch_in_a_pipeline_loop() -> None:
    """estimate_every=2 in a loop like WanPipeline's: cond then uncond per step, inside
    cache_context; each layer and branch estimates at sparse steps 1 and 3 and reuses at
    2 and 4; the next pipeline call (step index back to 0) estimates again."""
    from ditops.ops.estimate_block_mask import estimate_block_mask

    model = tiny_wan(keep_fp32=False)
    cfg = BlockSparseConfig(
        sparsity=0.25, skip_first_steps=1, block_size=32, stride=4, estimate_every=2
    )
    ditops.patch(model, attention=cfg)
    x = inputs(frames=4, hw=16)
    gen = torch.Generator().manual_seed(3)
    uncond = {**x, "encoder_hidden_states": torch.randn(1, 7, 16, generator=gen).bfloat16()}
    estimates: list[tuple[int | None, str | None]] = []
    steps = model._ditops_steps
    hook = estimate_block_mask.op.register_forward_hook(
        lambda *_: estimates.append((steps.current(), steps.branch))
    )
    try:
        for _call in range(2):
            for step in range(5):
                for name, kw in (("cond", x), ("uncond", uncond)):
                    with torch.inference_mode(), model.cache_context(name, step_index=step):
                        model(**kw, return_dict=False)
            per_call = list(estimates)
            estimates.clear()
            # 2 layers, each for both branches, at steps 1 and 3 only.
            assert per_call == [(s, b) for s in (1, 3) for b in ("cond", "uncond") for _ in (0, 1)]
    finally:
        hook.remove()
    # Block 1's self-attention sees the text through block 0: the branches differ there.
    masks = model.blocks[1].attn1.processor.sparse._thread_masks()
    assert set(masks) == {"cond", "uncond"}
    assert not torch.equal(masks["cond"].mask, masks["uncond"].mask)


def test_a_block_with_a_norm_of_another_kind_runs_diffusers_forward_and_says_why() -> None:
    model = tiny_wan(keep_fp32=False)
    model.blocks[1].norm1 = nn.LayerNorm(32, elementwise_affine=True)  # not what Wan has
    nn.init.normal_(model.blocks[1].norm1.weight)
    x = inputs()
    want = run(model, **x)
    report = ditops.patch(model, precision="exact")
    assert report.models["WanTransformer3DModel"]["fused blocks"] == 1
    assert report.models["WanTransformer3DModel"]["unfused blocks"] == 1
    why = report.unfused["WanTransformer3DModel"]["blocks.1"]
    assert "norm1 is a LayerNorm, not a LayerNorm without affine" in why
    assert "forward" not in vars(model.blocks[1])  # diffusers' own forward, untouched
    assert torch.equal(run(model, **x), want)


def test_generic_model_norms_swapped_keeping_weights() -> None:
    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)
            self.norm = nn.LayerNorm(16, elementwise_affine=False, eps=1e-6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(self.lin(x))

    model = Tiny().bfloat16()
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    with torch.inference_mode():
        ref = model(x)
    # exact: plain nn.LayerNorm computes in the model dtype, so it is left alone
    assert ditops.patch(model, precision="exact").models["Tiny"] == {}
    ditops.unpatch(model)
    ditops.patch(model, precision="fast")
    assert isinstance(model.norm, FP32LayerNorm) and model.norm.eps == 1e-6
    with torch.inference_mode():
        out = model(x)
    assert (out.float() - ref.float()).abs().max() <= 2 * 2**-7 * ref.float().abs().max()
    with pytest.raises(PatchError, match="sparse attention is supported for WanTransformer3DModel"):
        ditops.patch(model, attention=BlockSparseConfig(sparsity=0.5))


def test_bad_targets_and_options() -> None:
    with pytest.raises(PatchError, match="expects a diffusers model"):
        ditops.patch(object())
    with pytest.raises(PatchError, match="precision"):
        ditops.patch(nn.Linear(2, 2), precision="fastest")


def test_pipeline_patches_every_transformer() -> None:
    # A stand-in for a Wan2.2 pipeline: diffusers pipelines list their modules in
    # ``components``; the A14B one has ``transformer`` and ``transformer_2``.
    class Pipe:
        def __init__(self) -> None:
            self.components = {
                "transformer": tiny_wan(keep_fp32=False),
                "transformer_2": tiny_wan(keep_fp32=True),
                "vae": nn.Linear(2, 2),
                "scheduler": object(),
            }

    pipe = Pipe()
    x = inputs()
    refs = {n: run(pipe.components[n], **x) for n in ("transformer", "transformer_2")}
    report = ditops.patch(pipe, precision="exact")
    assert set(report.models) == {"transformer", "transformer_2"}
    assert "transformer: " in str(report) and "fused blocks" in str(report)
    for name, ref in refs.items():
        assert torch.equal(run(pipe.components[name], **x), ref)
    ditops.unpatch(pipe)
    assert not any(hasattr(pipe.components[n], "_ditops_patch") for n in refs)


def test_calls_without_a_step_index_count_steps_from_the_timestep() -> None:
    """Wan's image-to-video pipeline enters cache_context without a step index: the step
    is counted from the falling timestep (else skip_first_steps would keep every call
    dense); a step index, where given, wins and nothing is counted."""
    model = tiny_wan(keep_fp32=True)
    ditops.patch(model, attention=BlockSparseConfig(sparsity=0.5, skip_first_steps=1))
    x = inputs()
    with torch.inference_mode():
        for t in (900, 800, 700):
            with model.cache_context("cond"):
                model(**{**x, "timestep": torch.tensor([t])}, return_dict=False)
        assert model._ditops_steps.current() == 2
        with model.cache_context("cond", step_index=7):
            model(**x, return_dict=False)
            assert model._ditops_steps.current() == 7
        model(**{**x, "timestep": torch.tensor([950])}, return_dict=False)  # a new run
    assert model._ditops_steps.current() == 0
