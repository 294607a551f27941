"""A patched model's life: copies, pickling, patching again, bad options, hooks around it.

Regressions of issue 10 (items 2, 6, 7) and issue 8 (item 4, cache hooks): a deep copy of a
patched model ran the original's forward; pickling failed on a lock; a second ``patch``
call dropped the first's precision; bad options were accepted and broke the next forward;
a model with a diffusers hook could not be patched.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import nn

import ditops
from ditops.attention.schedule import BlockSparseConfig
from ditops.integrations import PatchError, set_step
from tests.integrations.test_diffusers_wan import inputs, run, tiny_wan

SPARSE = BlockSparseConfig(sparsity=0.5, skip_first_steps=1, block_size=32, stride=4)
MODES = {
    "norms": {"precision": "exact"},
    "attention": {"norms": False, "attention": SPARSE},
    "both": {"precision": "exact", "attention": SPARSE},
}


def video() -> dict[str, torch.Tensor]:
    return inputs(frames=4, hw=16)  # 256 tokens: 8 blocks of 32


def scale_weights(model: nn.Module, factor: float) -> None:
    with torch.no_grad():
        for block in model.blocks:
            block.ffn.net[0].proj.weight.data.mul_(factor)
            block.attn1.to_q.weight.data.mul_(factor)


@pytest.mark.parametrize("mode", list(MODES))
def test_deep_copy_is_an_independent_patched_model(mode: str) -> None:
    model = tiny_wan(keep_fp32=False)
    x = video()
    ditops.patch(model, **MODES[mode])
    before = run(model, step=1, **x)
    twin = copy.deepcopy(model)
    assert torch.equal(run(twin, step=1, **x), before)
    scale_weights(twin, 0.5)
    changed = run(twin, step=1, **x)
    assert not torch.equal(changed, before)  # the copy runs its own weights
    assert torch.equal(run(model, step=1, **x), before)  # and the original is untouched
    # the copy's patch is its own: unpatching it leaves the original patched
    reference = copy.deepcopy(twin)
    ditops.unpatch(reference)
    unpatched_copy = run(reference, step=1, **x)
    ditops.unpatch(twin)
    assert "forward" not in vars(twin.blocks[0]) and not hasattr(twin, "_ditops_patch")
    assert torch.equal(run(twin, step=1, **x), unpatched_copy)
    assert hasattr(model, "_ditops_patch")
    assert torch.equal(run(model, step=1, **x), before)
    if mode == "norms":  # exact norms: the copy, unpatched, is what it computed
        assert torch.equal(unpatched_copy, changed)


@pytest.mark.parametrize("mode", list(MODES))
def test_patched_model_pickles(mode: str) -> None:
    model = tiny_wan(keep_fp32=True)
    x = video()
    ditops.patch(model, **MODES[mode])
    before = run(model, step=1, **x)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert torch.equal(run(loaded, step=1, **x), before)
    assert pickle.loads(pickle.dumps(model))._ditops_patch.options == model._ditops_patch.options
    ditops.unpatch(loaded)
    assert not hasattr(loaded, "_ditops_patch") and "forward" not in vars(loaded.blocks[0])


def test_patching_again_combines_options() -> None:
    x = video()
    once = tiny_wan(keep_fp32=False)
    ditops.patch(once, precision="exact", attention=SPARSE)
    want = run(once, step=1, **x)

    model = tiny_wan(keep_fp32=False)
    ditops.patch(model, precision="exact")  # the README's two calls
    report = ditops.patch(model, attention=SPARSE)
    options = model._ditops_patch.options
    assert options.precision == "exact" and options.attention == SPARSE and options.norms
    assert report.models["WanTransformer3DModel"]["sparse self-attentions"] == 2
    assert model.blocks[0].norm2.precision == "exact"
    assert torch.equal(run(model, step=1, **x), want)
    # attention=None drops it; the precision stays
    ditops.patch(model, attention=None)
    assert model._ditops_patch.options.precision == "exact"
    assert not hasattr(model, "_ditops_steps")


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"attention": 0.5}, "ditops.BlockSparseConfig(sparsity=...)"),
        ({"attention": {"sparsity": 0.5}}, "must be None or a ditops.BlockSparseConfig"),
        ({"attention": "sparse"}, "must be None or a ditops.BlockSparseConfig"),
        ({"norms": 1}, "norms must be True or False"),
        ({"precision": "EXACT"}, "precision must be one of"),
    ],
)
def test_bad_options_are_refused_and_change_nothing(options: dict, fragment: str) -> None:
    model = tiny_wan(keep_fp32=False)
    x = inputs()
    ref = run(model, **x)
    with pytest.raises(PatchError) as info:
        ditops.patch(model, **options)
    assert fragment in str(info.value)
    assert not hasattr(model, "_ditops_patch")
    assert torch.equal(run(model, **x), ref)


@pytest.mark.parametrize("value", ["foo", "EXACT", 1, True])
def test_module_precision_is_validated_on_assignment(value: object) -> None:
    norm = ditops.FP32LayerNorm(8)
    with pytest.raises(ValueError, match="precision must be"):
        norm.precision = value  # type: ignore[assignment]
    assert norm.precision is None
    norm.precision = "exact"
    assert norm.precision == "exact"


@pytest.mark.parametrize("step", [True, -1, 1.0, "3"])
def test_set_step_refuses_what_is_not_a_step(step: object) -> None:
    model = tiny_wan(keep_fp32=False)
    ditops.patch(model, norms=False, attention=SPARSE)
    with pytest.raises(ValueError, match="step must be an int >= 0 or None"):
        set_step(model, step)  # type: ignore[arg-type]
    assert model._ditops_steps.manual is None
    run(model, **video())  # the next forward still works


def _fbc_run(model: nn.Module, x: dict, steps: int = 4) -> list[torch.Tensor]:
    """A short denoising loop with changing timesteps under a cache context, from fresh
    cache state (as a pipeline call starts)."""
    model._diffusers_hook.reset_stateful_hooks()
    outs = []
    with torch.inference_mode():
        for i in range(steps):
            with model.cache_context("cond", step_index=i):
                t = torch.tensor([900 - 10 * i])
                outs.append(model(**{**x, "timestep": t}, return_dict=False)[0])
    return outs


@pytest.mark.parametrize("mode", list(MODES))
def test_first_block_cache_in_both_orders(mode: str) -> None:
    from diffusers import FirstBlockCacheConfig

    x = video()
    cache = FirstBlockCacheConfig(threshold=0.2)
    plain = tiny_wan(keep_fp32=False)
    plain.enable_cache(cache)
    want_unpatched = _fbc_run(plain, x)

    patch_first = tiny_wan(keep_fp32=False)
    ditops.patch(patch_first, **MODES[mode])
    patch_first.enable_cache(cache)
    want = _fbc_run(patch_first, x)

    hook_first = tiny_wan(keep_fp32=False)
    hook_first.enable_cache(cache)
    ditops.patch(hook_first, **MODES[mode])
    got = _fbc_run(hook_first, x)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    # unpatch under the hook: the unpatched model with the hook again
    ditops.unpatch(hook_first)
    got = _fbc_run(hook_first, x)
    if mode == "norms":  # exact norms: bitwise the unpatched model throughout
        assert all(torch.equal(a, b) for a, b in zip(want, want_unpatched))
    assert all(torch.equal(a, b) for a, b in zip(got, want_unpatched))
    # and the hook can still be removed after the patch came and went
    hook_first.disable_cache()
    for block in hook_first.blocks:  # diffusers leaves the class's forward, bound
        assert getattr(block.forward, "__func__", None) is type(block).forward


def test_a_forward_replaced_by_something_unknown_is_kept_and_named() -> None:
    model = tiny_wan(keep_fp32=False)
    calls = []
    original = model.blocks[1].forward

    def my_forward(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return original(*args, **kwargs)

    model.blocks[1].forward = my_forward
    report = ditops.patch(model)
    why = report.unfused["WanTransformer3DModel"]["blocks.1"]
    assert "blocks[1].forward is replaced" in why and "my_forward" in why
    assert model.blocks[1].forward is my_forward  # the user's, as set
    with torch.inference_mode():
        model(**inputs(), return_dict=False)
    assert calls == [1]
