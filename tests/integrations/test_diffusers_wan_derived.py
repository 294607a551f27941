"""ditops.patch on the Wan-derived diffusers models, tiny and built from keyword arguments.

VACE (``WanVACETransformer3DModel``: Wan blocks plus VACE blocks making the hints),
SkyReels-V2 (``SkyReelsV2Transformer3DModel``: per-frame modulation under diffusion
forcing, causal frame-block masks), ChronoEdit (``ChronoEditTransformer3DModel``) and
Wan-Animate (``WanAnimateTransformer3DModel``: face adapters between the blocks). Their
blocks and processors are recognised by the fingerprints of their source, not by name.

Exact precision: bitwise the unpatched model (fp32, bf16, bf16 with the fp32-kept modules),
every fused op counted as running (a silent fall back to eager code fails); sparse
attention: dense steps bitwise, sparse steps close with the density asked; refusal of
blocks and processors that differ (nothing changed); unpatch restores; a deep copy is an
independent patched model.
"""

from __future__ import annotations

import copy
import logging
import types

import pytest
import torch
from diffusers import (
    ChronoEditTransformer3DModel,
    SkyReelsV2Transformer3DModel,
    WanAnimateTransformer3DModel,
    WanVACETransformer3DModel,
)
from torch import nn

import ditops
from ditops.attention.schedule import BlockSparseConfig
from ditops.bench.wan_model import cast_like_from_pretrained
from ditops.integrations import PatchError
from ditops.layers.norm import FP32LayerNorm
from tests.integrations.spies import WAN_OPS, cpu_paths_of
from tests.integrations.test_diffusers_wan import TINY

ANIMATE = dict(
    latent_channels=4,
    in_channels=12,
    image_dim=None,
    motion_encoder_channel_sizes={"16": 8, "8": 8, "4": 8},
    motion_encoder_size=16,
    motion_style_dim=8,
    motion_dim=4,
    motion_encoder_dim=8,
    face_encoder_hidden_dim=8,
    face_encoder_num_heads=2,
    inject_face_latents_blocks=1,
    motion_encoder_batch_size=4,
)
MODELS = ("vace", "skyreels_v2", "chronoedit", "animate")
CLASSES = {
    "vace": WanVACETransformer3DModel,
    "skyreels_v2": SkyReelsV2Transformer3DModel,
    "chronoedit": ChronoEditTransformer3DModel,
    "animate": WanAnimateTransformer3DModel,
}
#: blocks fused per model (VACE: 2 Wan blocks and 2 VACE blocks, each with a prologue).
SELF_ATTENTIONS = {"vace": 4, "skyreels_v2": 2, "chronoedit": 2, "animate": 2}
DTYPES = ("fp32", "bf16", "bf16_fp32_modules")


def build(name: str, dtype: str = "bf16", **overrides: object) -> nn.Module:
    torch.manual_seed(0)
    kw: dict = dict(TINY)  # tiny Wan's (test_diffusers_wan.py)
    if name == "vace":
        kw.update(vace_layers=[0, 1], vace_in_channels=8)
    if name == "animate":
        kw.update(ANIMATE)
    model = CLASSES[name](**{**kw, **overrides}).eval()
    if dtype == "fp32":
        return model
    if dtype == "bf16_fp32_modules":  # what from_pretrained(torch_dtype=bf16) does
        return cast_like_from_pretrained(model, torch.bfloat16)
    return model.to(torch.bfloat16)


def inputs(name: str, dtype: str = "bf16", frames: int = 2, hw: int = 8) -> dict:
    g = torch.Generator().manual_seed(1)
    x: dict = {
        "hidden_states": torch.randn(1, 4, frames, hw, hw, generator=g),
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": torch.randn(1, 7, 16, generator=g),
    }
    if name == "vace":
        x["control_hidden_states"] = torch.randn(1, 8, frames, hw, hw, generator=g)
    if name == "animate":  # the reference frame first, then frames - 1 posed frames
        x["hidden_states"] = torch.randn(1, 12, frames, hw, hw, generator=g)
        x["pose_hidden_states"] = torch.randn(1, 4, frames - 1, hw, hw, generator=g)
        x["face_pixel_values"] = torch.randn(1, 3, 4 * (frames - 1), 16, 16, generator=g)
    if dtype != "fp32":
        x = {k: v.bfloat16() if v.is_floating_point() else v for k, v in x.items()}
    return x


def run(model: nn.Module, step: int | None = None, **kw: object) -> torch.Tensor:
    with torch.inference_mode():
        if step is None:
            return model(**kw, return_dict=False)[0]
        with model.cache_context("cond", step_index=step):
            return model(**kw, return_dict=False)[0]


cpu_paths = cpu_paths_of(*WAN_OPS)  # counts the calls reaching each op's forward_cpu


def fused_calls(blocks: int) -> dict[str, int]:
    """What one forward of ``blocks`` fused blocks and norm_out run on the fused ops."""
    return {
        "layer_norm_scale_shift": blocks,
        "scale_residual_layer_norm_scale_shift": 2 * blocks,
        "gated_residual": blocks,
        "fp32_layer_norm": 1,
        "qk_norm_rope": blocks,
    }


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", MODELS)
def test_exact_is_bitwise_fused_ops_run_and_unpatch_restores(
    name: str, dtype: str, cpu_paths: dict[str, int]
) -> None:
    model = build(name, dtype)
    x = inputs(name, dtype)
    processors = [type(b.attn1.processor) for b in model.modules() if hasattr(b, "attn1")]
    ref = run(model, **x)
    report = ditops.patch(model, precision="exact")
    summary = report.models[type(model).__name__]
    assert summary["fused blocks"] == 2
    assert summary.get("fused vace blocks", 0) == (2 if name == "vace" else 0)
    assert summary["fused attention prologues"] == SELF_ATTENTIONS[name]
    assert "unfused blocks" not in summary and not report.unfused
    assert isinstance(model.norm_out, FP32LayerNorm)
    assert torch.equal(run(model, **x), ref)
    assert cpu_paths == fused_calls(SELF_ATTENTIONS[name])
    places = ditops.explain_patch(model)[type(model).__name__]
    assert all(v == "fused" for k, v in places.items() if k)  # "": the arithmetic matched
    ditops.unpatch(model)
    after = [type(b.attn1.processor) for b in model.modules() if hasattr(b, "attn1")]
    assert after == processors
    assert not any("forward" in vars(b) for b in model.blocks)
    assert torch.equal(run(model, **x), ref)


@pytest.mark.parametrize("dtype", ("fp32", "bf16"))
def test_skyreels_diffusion_forcing_per_frame_timesteps_and_causal_mask_bitwise(
    dtype: str, cpu_paths: dict[str, int]
) -> None:
    """Diffusion forcing: a timestep per latent frame (modulation ``[B, 6, L, C]``), the
    fps embedding, and a causal mask over blocks of 2 frames handed to self-attention."""
    model = build("skyreels_v2", dtype, inject_sample_info=True, num_frame_per_block=2)
    x = inputs("skyreels_v2", dtype, frames=4)
    x.update(timestep=torch.tensor([[0, 250, 500, 750]]), enable_diffusion_forcing=True, fps=[1])
    ref = run(model, **x)
    ditops.patch(model, precision="exact")
    assert torch.equal(run(model, **x), ref)
    assert cpu_paths == fused_calls(2)  # the prologue runs with the mask too


def test_fast_precision_within_tolerance() -> None:
    for name in MODELS:
        model = build(name, "bf16_fp32_modules")
        x = inputs(name)
        ref = run(model, **x).float()
        ditops.patch(model, precision="fast")
        out = run(model, **x).float()
        assert (out - ref).abs().max() / ref.abs().max() <= 2e-2, name


def _densities(calls: list) -> list[float]:
    return [float(counts.float().mean() / mask.shape[-1]) for mask, counts in calls]


@pytest.mark.parametrize("name", MODELS)
def test_sparse_density_asked_is_run_and_dense_steps_are_bitwise(
    name: str, estimates: list
) -> None:
    """4 frames of 8 x 8 tokens (256, 16 key blocks of 16): step 0 dense and bitwise, step
    1 block-sparse at density 0.5 (to within one block of a row), close to dense."""
    model = build(name)
    x = inputs(name, frames=4, hw=16)
    refs = [run(model, step=i, **x) for i in range(2)]
    cfg = BlockSparseConfig(sparsity=0.5, skip_first_steps=1, block_size=16, stride=4)
    report = ditops.patch(model, precision="exact", attention=cfg)
    assert report.models[type(model).__name__]["sparse self-attentions"] == SELF_ATTENTIONS[name]
    assert torch.equal(run(model, step=0, **x), refs[0])
    assert estimates == []
    sparse = run(model, step=1, **x)
    assert len(estimates) == SELF_ATTENTIONS[name]
    assert all(abs(d - 0.5) <= 1 / 16 for d in _densities(estimates)), _densities(estimates)
    assert not torch.equal(sparse, refs[1])
    cos = torch.nn.functional.cosine_similarity(
        sparse.float().flatten(), refs[1].float().flatten(), 0
    )
    assert cos > 0.95, cos
    ditops.unpatch(model)
    assert torch.equal(run(model, step=1, **x), refs[1])


def test_steps_counted_from_timesteps_as_their_pipelines_call(estimates: list) -> None:
    """Their pipelines enter cache_context("cond") without a step index: the step is
    counted from the falling timestep; the same timestep again is a new pipeline call."""
    model = build("chronoedit")
    x = inputs("chronoedit", frames=4, hw=16)
    later = {**x, "timestep": torch.tensor([400])}
    ref, ref_later = run(model, **x), run(model, **later)
    cfg = BlockSparseConfig(sparsity=0.5, skip_first_steps=1, block_size=16, stride=4)
    ditops.patch(model, precision="exact", attention=cfg)

    def call(kw: dict) -> torch.Tensor:
        with torch.inference_mode(), model.cache_context("cond"):
            return model(**kw, return_dict=False)[0]

    assert torch.equal(call(x), ref)  # step 0: dense
    assert not torch.equal(call(later), ref_later) and len(estimates) == 2  # step 1: sparse
    assert torch.equal(call(x), ref)  # a new pipeline call: step 0 again


def test_skyreels_causal_mask_runs_dense_on_sparse_steps_and_warns(
    caplog: pytest.LogCaptureFixture, estimates: list
) -> None:
    """Block-sparse attention takes no mask: with SkyReels-V2's causal frame blocks a
    sparse step runs dense attention with the mask, bitwise the unpatched model."""
    from ditops.integrations.wan import attention as wan_attention

    model = build("skyreels_v2", num_frame_per_block=2)
    x = inputs("skyreels_v2", frames=4, hw=16)
    ref = run(model, step=1, **x)
    cfg = BlockSparseConfig(sparsity=0.5, block_size=16, stride=4)
    ditops.patch(model, precision="exact", attention=cfg)
    wan_attention._WARNED.clear()
    with caplog.at_level(logging.WARNING, logger="ditops"):
        assert torch.equal(run(model, step=1, **x), ref)
    assert estimates == []
    assert any("attention mask" in r.message for r in caplog.records)
    model.register_to_config(num_frame_per_block=1)  # no mask: sparse runs
    run(model, step=1, **x)
    assert len(estimates) == 2


def test_deepcopy_is_an_independent_patched_model() -> None:
    model = build("vace")
    x = inputs("vace", frames=4, hw=16)
    refs = [run(model, step=i, **x) for i in range(2)]
    cfg = BlockSparseConfig(sparsity=0.5, skip_first_steps=1, block_size=16, stride=4)
    ditops.patch(model, precision="exact", attention=cfg)
    sparse = run(model, step=1, **x)
    twin = copy.deepcopy(model)
    ditops.unpatch(model)
    assert torch.equal(run(model, step=1, **x), refs[1])
    assert hasattr(twin, "_ditops_patch") and "forward" in vars(twin.vace_blocks[0])
    assert twin.blocks[0].attn1.processor is not model.blocks[0].attn1.processor
    assert torch.equal(run(twin, step=0, **x), refs[0])
    assert torch.equal(run(twin, step=1, **x), sparse)


def test_processors_build_as_diffusers_loaders_build_them() -> None:
    """``type(p)()`` (diffusers' loaders) wraps the model's own processor class."""
    for name in MODELS:
        model = build(name)
        want = type(model.blocks[0].attn1.processor)
        ditops.patch(model, precision="exact")
        ours = model.blocks[0].attn1.processor
        assert type(type(ours)().original) is want, name


def _altered(cls: type, method: str) -> type:
    """A subclass of ``cls`` whose ``method`` does the same but reads differently."""

    def changed(self, *args, **kwargs):
        return getattr(cls, method)(self, *args, **kwargs)

    return types.new_class(
        f"Altered{cls.__name__}", (cls,), {}, lambda ns: ns.update({method: changed})
    )


def _processors(model: nn.Module) -> list:
    return [m.processor for m in model.modules() if hasattr(m, "processor")]


def test_a_vace_block_whose_forward_differs_is_refused_changing_nothing() -> None:
    model = build("vace")
    model.vace_blocks[1].__class__ = _altered(type(model.vace_blocks[1]), "forward")
    before = _processors(model)
    with pytest.raises(PatchError, match=r"vace_blocks\[1\] is a AlteredWanVACETransformerBlock"):
        ditops.patch(model, precision="exact")
    assert _processors(model) == before and not hasattr(model, "_ditops_patch")
    assert not isinstance(model.blocks[0].norm1, FP32LayerNorm)


def test_a_skyreels_processor_whose_call_differs_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another diffusers version's SkyReelsV2AttnProcessor (its __call__ differs) is
    refused, naming it; so is a processor class ditops does not know."""
    from diffusers.models.transformers import transformer_skyreels_v2 as sky

    model = build("skyreels_v2")
    proc = model.blocks[0].attn1.processor
    original = sky.SkyReelsV2AttnProcessor.__call__

    def changed(self, *args, **kwargs):
        return original(self, *args, **kwargs)

    monkeypatch.setattr(sky.SkyReelsV2AttnProcessor, "__call__", changed)
    with pytest.raises(PatchError, match=r"SkyReelsV2AttnProcessor.__call__ \(fingerprint"):
        ditops.patch(model, attention=BlockSparseConfig(sparsity=0.5))
    assert model.blocks[0].attn1.processor is proc and not hasattr(model, "_ditops_patch")
    monkeypatch.undo()
    proc.__class__ = _altered(type(proc), "__call__")
    with pytest.raises(PatchError, match="not WanAttnProcessor"):
        ditops.patch(model, precision="exact")
    assert model.blocks[0].attn1.processor is proc


def test_a_copied_block_under_another_name_is_recognised_by_its_code() -> None:
    """A model ditops has no name for, made of Wan blocks: recognised by the fingerprint
    of its blocks' forward, and fused."""
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock

    class MyWanLike(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([WanTransformerBlock(32, 48, 2, cross_attn_norm=True)])

    report = ditops.patch(MyWanLike(), precision="exact")
    assert report.models["MyWanLike"]["fused blocks"] == 1
    with pytest.raises(PatchError, match="needs the model's config.patch_size"):
        ditops.patch(MyWanLike(), attention=BlockSparseConfig(sparsity=0.5))


@pytest.mark.parametrize("name", ("vace", "skyreels_v2"))
def test_compiled_fullgraph_exact_is_bitwise(name: str) -> None:
    """torch.compile(fullgraph=True) of the patched model (aot_eager backend): VACE's
    (hint, control) tuple and SkyReels-V2's diffusion forcing with its causal mask."""
    extra = {"num_frame_per_block": 2} if name == "skyreels_v2" else {}
    model = build(name, "bf16_fp32_modules", **extra)
    x = inputs(name, frames=4)
    if name == "skyreels_v2":
        x.update(timestep=torch.tensor([[0, 250, 500, 750]]), enable_diffusion_forcing=True)
    ref = run(model, **x)
    ditops.patch(model, precision="exact")
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    assert torch.equal(run(compiled, **x), ref)


def test_a_patched_model_pickles() -> None:
    import io

    model = build("skyreels_v2")
    x = inputs("skyreels_v2", frames=4, hw=16)
    cfg = BlockSparseConfig(sparsity=0.5, block_size=16, stride=4)
    ditops.patch(model, precision="exact", attention=cfg)
    want = run(model, step=1, **x)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert type(loaded.blocks[0].attn1.processor).__name__ == "SkyReelsV2SelfAttnProcessor"
    assert torch.equal(run(loaded, step=1, **x), want)


def test_diffusion_forcing_steps_counted_from_the_mean_per_frame_timestep(
    estimates: list,
) -> None:
    """SkyReels-V2's diffusion-forcing pipeline: cache_context("cond") without a step
    index, a timestep per frame; the mean falls at each iteration of a segment."""
    model = build("skyreels_v2")
    x = inputs("skyreels_v2", frames=4, hw=16)
    x["enable_diffusion_forcing"] = True
    cfg = BlockSparseConfig(sparsity=0.5, skip_first_steps=1, block_size=16, stride=4)
    ditops.patch(model, precision="exact", attention=cfg)
    steps = []
    for t in ([0, 250, 500, 750], [0, 200, 450, 700], [0, 0, 400, 650], [0, 250, 500, 750]):
        with torch.inference_mode(), model.cache_context("cond"):
            model(**{**x, "timestep": torch.tensor([t])}, return_dict=False)
        steps.append(model._ditops_steps.current())
    assert steps == [0, 1, 2, 0]  # the last: a new segment (or pipeline call)
    assert len(estimates) == 2 * 2  # sparse at steps 1 and 2, 2 blocks each


def test_a_hooked_vace_block_norm_runs_that_block_unfused_bitwise() -> None:
    """The ecosystem rule for the VACE blocks too: a hook on a bypassed norm makes that
    block run diffusers' forward (the hook runs), the others stay fused."""
    model = build("vace")
    x = inputs("vace")
    ref = run(model, **x)
    ditops.patch(model, precision="exact")
    seen = []
    model.vace_blocks[0].norm3.register_forward_hook(lambda *_: seen.append(1))
    assert torch.equal(run(model, **x), ref)
    assert seen == [1]
    explained = ditops.explain_patch(model)["WanVACETransformer3DModel"]
    assert explained["vace_blocks.0"] == "norm3 has a torch forward hook"
    assert explained["vace_blocks.1"] == "fused" and explained["blocks.0"] == "fused"
