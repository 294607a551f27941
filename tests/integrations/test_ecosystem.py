"""What users combine a patched model with: hooks on submodules, modules and processors of
their own, diffusers' loaders (IP-Adapter, LayerSkip), cache hooks, state-dict loading,
meta init, compiled models, the precision in force and threads. Each test is one finding
of the ecosystem issue; each failed on the code before it (the finding says how)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ditops
from ditops.attention.schedule import BlockSparseConfig
from tests.integrations import test_diffusers_flux as flux_t
from tests.integrations import test_diffusers_wan as wan_t

SPARSE = BlockSparseConfig(sparsity=0.5, block_size=32, stride=4, skip_first_steps=1)


def wan() -> tuple[nn.Module, dict]:
    return wan_t.tiny_wan(keep_fp32=True), wan_t.inputs(frames=4, hw=16)


def flux() -> tuple[nn.Module, dict]:
    return flux_t.tiny_flux(), flux_t.inputs()


def run(model: nn.Module, x: dict, step: int = 0, **extra: object) -> torch.Tensor:
    with torch.inference_mode(), model.cache_context("cond", step_index=step):
        return model(**x, **extra, return_dict=False)[0].clone()


BUILD = {"wan": wan, "flux": flux}


# --- hooks on the modules a fused block bypasses -----------------------------------------------

#: (family, the submodule) where a hook was never called after the patch.
HOOKED = [
    ("wan", "blocks.0.norm2"),
    ("wan", "norm_out"),
    ("wan", "blocks.1.attn1.norm_q"),
    ("flux", "transformer_blocks.0.norm1"),
    ("flux", "transformer_blocks.1.norm2_context"),
    ("flux", "single_transformer_blocks.0.norm"),
    ("flux", "single_transformer_blocks.1.attn.norm_k"),
]


@pytest.mark.parametrize("order", ["hook-first", "patch-first"])
@pytest.mark.parametrize(("family", "name"), HOOKED)
def test_a_hook_that_edits_a_bypassed_module_output_is_honoured(
    family: str, name: str, order: str
) -> None:
    def edit(module: nn.Module, args: object, out: object) -> object:
        calls.append(name)
        if isinstance(out, tuple):
            return (out[0] * 1.5, *out[1:])
        return out * 1.5

    calls: list[str] = []
    plain, x = BUILD[family]()
    plain.get_submodule(name).register_forward_hook(edit)
    want = run(plain, x)
    calls.clear()

    model, _ = BUILD[family]()
    if order == "hook-first":
        model.get_submodule(name).register_forward_hook(edit)
        ditops.patch(model, precision="exact")
    else:
        ditops.patch(model, precision="exact")
        model.get_submodule(name).register_forward_hook(edit)
    got = run(model, x)
    assert calls == [name]
    assert torch.equal(got, want)


@pytest.mark.parametrize("family", ["wan", "flux"])
def test_a_module_the_user_sets_after_the_patch_is_the_one_that_runs(family: str) -> None:
    class MyNorm(nn.LayerNorm):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 0.5 + 0.25

    where = {"wan": "blocks.1.norm3", "flux": "transformer_blocks.0.norm2"}[family]
    parent_name, attr = where.rsplit(".", 1)

    def mine(old: nn.Module) -> nn.Module:
        return MyNorm(old.normalized_shape, eps=old.eps, elementwise_affine=False)

    plain, x = BUILD[family]()
    setattr(plain.get_submodule(parent_name), attr, mine(plain.get_submodule(where)))
    want = run(plain, x)
    model, _ = BUILD[family]()
    ditops.patch(model, precision="exact")
    setattr(model.get_submodule(parent_name), attr, mine(model.get_submodule(where)))
    assert torch.equal(run(model, x), want)
    place = where.rsplit(".", 1)[0]
    assert "MyNorm" in ditops.explain_patch(model)[type(model).__name__][place]
    # A re-patch keeps the user's norm (it used to put the original back).
    ditops.patch(model, precision="fast")
    assert type(model.get_submodule(where)) is MyNorm
    ditops.unpatch(model)
    assert type(model.get_submodule(where)) is MyNorm
    assert torch.equal(run(model, x), want)


# --- diffusers' cache hooks, both orders -------------------------------------------------------


def _cache_configs() -> dict[str, object]:
    from diffusers import (
        FirstBlockCacheConfig,
        MagCacheConfig,
        PyramidAttentionBroadcastConfig,
        TaylorSeerCacheConfig,
    )
    from diffusers.hooks import SeaCacheConfig

    return {
        "first-block": FirstBlockCacheConfig(threshold=0.2),
        "pyramid-broadcast": PyramidAttentionBroadcastConfig(
            spatial_attention_block_skip_range=2,
            spatial_attention_timestep_skip_range=(-1, 1000),
            current_timestep_callback=lambda: 500,
        ),
        "taylorseer": TaylorSeerCacheConfig(
            cache_interval=2, disable_cache_before_step=1, taylor_factors_dtype=torch.float32
        ),
        "mag": MagCacheConfig(threshold=0.5, num_inference_steps=4, mag_ratios=[1, 1, 0.99, 0.98]),
        "sea": SeaCacheConfig(threshold=0.5),
    }


# FasterCache is left out: on these tiny models it fails unpatched too (its hooks expect
# batched classifier-free guidance inputs).
@pytest.mark.parametrize("order", ["cache-first", "patch-first"])
@pytest.mark.parametrize("cache", list(_cache_configs()))
@pytest.mark.parametrize("family", ["wan", "flux"])
def test_every_cache_hook_gives_the_unpatched_model_with_it(
    family: str, cache: str, order: str
) -> None:
    def steps(model: nn.Module, x: dict) -> list[torch.Tensor]:
        outs = []
        with torch.inference_mode():
            for s in range(4):
                with model.cache_context(
                    "cond", step_index=s, num_inference_steps=4, sigma=1 - s / 4
                ):
                    outs.append(model(**x, return_dict=False)[0].clone())
        return outs

    plain, x = BUILD[family]()
    plain.enable_cache(_cache_configs()[cache])
    want = steps(plain, x)
    model, _ = BUILD[family]()
    if order == "cache-first":
        model.enable_cache(_cache_configs()[cache])
        ditops.patch(model, precision="exact")
    else:
        ditops.patch(model, precision="exact")
        model.enable_cache(_cache_configs()[cache])
    for g, w in zip(steps(model, x), want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("family", ["wan", "flux"])
def test_faster_cache_fails_alike_patched_and_unpatched(family: str) -> None:
    """FasterCache is out of the table above: on these tiny models its hooks fail unpatched
    (they expect batched classifier-free guidance inputs); patched, it fails the same way."""
    from diffusers import FasterCacheConfig

    def attempt(patched: bool) -> str:
        model, x = BUILD[family]()
        if patched:
            ditops.patch(model, precision="exact")
        model.enable_cache(FasterCacheConfig(
            spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(-1, 1000),
            current_timestep_callback=lambda: 500, is_guidance_distilled=True))  # fmt: skip
        with pytest.raises(TypeError) as err:
            for s in range(3):
                run(model, x, step=s)
        return str(err.value)

    assert attempt(True) == attempt(False)


# --- loaders that rebuild processors -----------------------------------------------------------


def _ip_adapter_state(model: nn.Module) -> dict:
    """Random IP-Adapter weights in the layout FLUX's loader reads (one image embedding)."""
    from diffusers.models.embeddings import ImageProjection
    from diffusers.models.transformers.transformer_flux import FluxIPAdapterAttnProcessor

    cfg = model.config
    torch.manual_seed(3)
    adapter = {}
    doubles = [n for n in model.attn_processors if not n.startswith("single_transformer_blocks")]
    for i, _ in enumerate(doubles):
        sd = FluxIPAdapterAttnProcessor(
            hidden_size=cfg.num_attention_heads * cfg.attention_head_dim,
            cross_attention_dim=cfg.joint_attention_dim,
        ).state_dict()
        for part in ("k", "v"):
            for kind in ("weight", "bias"):
                adapter[f"{i}.to_{part}_ip.{kind}"] = sd[f"to_{part}_ip.0.{kind}"]
    proj = ImageProjection(
        cross_attention_dim=cfg.joint_attention_dim,
        image_embed_dim=cfg.pooled_projection_dim,
        num_image_text_embeds=4,
    ).state_dict()
    image_proj = {
        "proj.weight": proj["image_embeds.weight"],
        "proj.bias": proj["image_embeds.bias"],
        "norm.weight": proj["norm.weight"],
        "norm.bias": proj["norm.bias"],
    }
    return {"image_proj": image_proj, "ip_adapter": adapter}


def _with_ip(model: nn.Module, x: dict) -> torch.Tensor:
    embeds = torch.randn(1, 1, 12, generator=torch.Generator().manual_seed(5)).bfloat16()
    return run(model, x, joint_attention_kwargs={"ip_adapter_image_embeds": [embeds]})


def test_flux_ip_adapter_loaded_after_the_patch_gives_loading_it_before() -> None:
    before, x = flux()
    before._load_ip_adapter_weights([_ip_adapter_state(before)])
    ditops.patch(before, precision="exact")
    after, _ = flux()
    ditops.patch(after, precision="exact")
    after._load_ip_adapter_weights([_ip_adapter_state(after)])  # TypeError before the fix
    plain, _ = flux()
    plain._load_ip_adapter_weights([_ip_adapter_state(plain)])
    want = _with_ip(plain, x)
    assert torch.equal(_with_ip(before, x), want)
    assert torch.equal(_with_ip(after, x), want)
    ditops.unpatch(after)  # the loader's processors stay
    assert torch.equal(_with_ip(after, x), want)


@pytest.mark.parametrize("family", ["wan", "flux"])
def test_processors_build_as_diffusers_builds_them(family: str) -> None:
    model, x = BUILD[family]()
    want = run(model, x)
    ditops.patch(model, precision="exact")
    model.set_attn_processor({n: type(p)() for n, p in model.attn_processors.items()})
    assert torch.equal(run(model, x), want)


def _layer_skips(family: str) -> dict[str, dict]:
    fqn = {"wan": "blocks", "flux": "transformer_blocks"}[family]
    skips = {
        "ff": {"skip_attention": False, "skip_ff": True},
        "block": {"skip_attention": True, "skip_ff": True},
    }
    if family == "wan":  # FLUX's attention lacks is_cross_attention: diffusers fails unpatched
        skips["attention"] = {"skip_attention": True, "skip_ff": False}
        skips["attention-scores"] = {"skip_attention": False, "skip_attention_scores": True,
                                     "skip_ff": False}  # fmt: skip
    return {k: {"indices": [0], "fqn": fqn, **v} for k, v in skips.items()}


LAYER_SKIPS = [(f, k) for f in ("wan", "flux") for k in _layer_skips(f)]


@pytest.mark.parametrize(("family", "skip"), LAYER_SKIPS)
def test_layer_skip_after_the_patch_gives_the_unpatched_model_with_it(
    family: str, skip: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from diffusers.hooks import LayerSkipConfig, apply_layer_skip
    from diffusers.hooks._helpers import AttentionProcessorRegistry
    from diffusers.models.transformers import transformer_wan

    # diffusers 0.42 registers WanAttnProcessor2_0 but not the WanAttnProcessor Wan uses:
    # register it here (as a newer diffusers would) so the unpatched model can be skipped.
    AttentionProcessorRegistry._register()
    registry = AttentionProcessorRegistry._registry
    monkeypatch.setitem(
        registry, transformer_wan.WanAttnProcessor, registry[transformer_wan.WanAttnProcessor2_0]
    )
    kw = _layer_skips(family)[skip]
    plain, x = BUILD[family]()
    apply_layer_skip(plain, LayerSkipConfig(**kw))
    want = run(plain, x)
    model, _ = BUILD[family]()
    ditops.patch(model, precision="exact")
    apply_layer_skip(model, LayerSkipConfig(**kw))  # "... not registered" before the fix
    assert torch.equal(run(model, x), want)
    assert not torch.equal(want, run(BUILD[family]()[0], x))  # the skip changed something
