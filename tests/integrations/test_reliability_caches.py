"""A diffusers cache enabled and then disabled leaves its hook registry on each block,
empty, and the block's own forward bound on the instance: that is not a hook. After
``enable_cache(...)`` then ``disable_cache()``, ``ditops.patch`` fuses every block of
FLUX, Wan, LTX-Video and CogVideoX and patches HunyuanVideo (it used to leave every block
unfused, and refuse HunyuanVideo whole, saying "apply ditops.patch first"), bitwise in
exact precision.
"""

from __future__ import annotations

from collections.abc import Callable

import diffusers
import pytest
import torch
from torch import nn

import ditops
from tests.integrations import test_diffusers_cogvideox as cv_t
from tests.integrations import test_diffusers_flux as flux_t
from tests.integrations import test_diffusers_hunyuan_video as hv_t
from tests.integrations import test_diffusers_hunyuan_video15 as hv15_t
from tests.integrations import test_diffusers_ltx_video as ltx_t
from tests.integrations import test_diffusers_wan as wan_t

#: The caches that hook whole blocks (the ones whose leftovers the blocks' patch meets).
CACHES: dict[str, Callable[[], object]] = {
    "first_block": lambda: diffusers.FirstBlockCacheConfig(threshold=0.1),
    "mag": lambda: diffusers.MagCacheConfig(num_inference_steps=4, mag_ratios=[1.0] * 4),
    "sea": lambda: diffusers.SeaCacheConfig(),
}

#: family -> (model, inputs, run, the number of blocks it fuses)
FAMILIES: dict[
    str, tuple[Callable[[], nn.Module], Callable[[], dict], Callable[..., torch.Tensor], int]
] = {
    "wan": (lambda: wan_t.tiny_wan(keep_fp32=True), wan_t.inputs, wan_t.run, 2),
    "flux": (flux_t.tiny_flux, flux_t.inputs, flux_t.run, 4),
    "hunyuan_video": (hv_t.tiny_hunyuan, hv_t.inputs, hv_t.run, 4),
    "ltx_video": (ltx_t.tiny_ltx, ltx_t.inputs, ltx_t.run, 2),
    "cogvideox": (cv_t.tiny_cogvideox, lambda: cv_t.inputs(cv_t.tiny_cogvideox()), cv_t.run, 2),
}


@pytest.mark.parametrize("cache", sorted(CACHES))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_cache_enabled_then_disabled_leaves_every_block_fused(family: str, cache: str) -> None:
    make, inputs, run, blocks = FAMILIES[family]
    model, x = make(), inputs()
    ref = run(model, **x)
    model.enable_cache(CACHES[cache]())
    model.disable_cache()
    report = ditops.patch(model, precision="exact")
    summary = report.models[type(model).__name__]
    assert summary.get("fused blocks") == blocks, report
    assert report.unfused == {}
    places = ditops.explain_patch(model)[type(model).__name__]
    assert {v for k, v in places.items() if k} == {"fused"}
    assert torch.equal(run(model, **x), ref)
    ditops.unpatch(model)
    assert torch.equal(run(model, **x), ref)


def test_a_hook_registered_then_removed_on_hunyuan_video15_blocks() -> None:
    """HunyuanVideo-1.5 takes none of the block caches: the same leftover, made with
    diffusers' HookRegistry directly."""
    from diffusers.hooks import HookRegistry, ModelHook

    model, x = hv15_t.tiny_model(), hv15_t.inputs()
    ref = hv15_t.run(model, **x)
    for block in model.transformer_blocks:
        registry = HookRegistry.check_if_exists_or_initialize(block)
        registry.register_hook(ModelHook(), "probe")
        registry.remove_hook("probe")
        assert "forward" in vars(block)  # the leftover
    report = ditops.patch(model, precision="exact")
    assert report.models["HunyuanVideo15Transformer3DModel"]["fused blocks"] == 2
    assert torch.equal(hv15_t.run(model, **x), ref)


def test_a_leftover_forward_on_a_bypassed_norm_is_not_a_hook() -> None:
    """The same leftover on a norm a fused Wan block computes without calling it."""
    from diffusers.hooks import HookRegistry, ModelHook

    model, x = wan_t.tiny_wan(keep_fp32=True), wan_t.inputs()
    ref = wan_t.run(model, **x)
    for block in model.blocks:
        registry = HookRegistry.check_if_exists_or_initialize(block.norm2)
        registry.register_hook(ModelHook(), "probe")
        registry.remove_hook("probe")
    report = ditops.patch(model, precision="exact")
    assert report.models["WanTransformer3DModel"]["fused blocks"] == 2, report
    assert torch.equal(wan_t.run(model, **x), ref)
    ditops.unpatch(model)
    assert torch.equal(wan_t.run(model, **x), ref)
    norm2 = model.blocks[0].norm2
    assert vars(norm2)["forward"].__func__ is type(norm2).forward  # the leftover is back
