"""A step set by hand (``ditops.set_step``) and the pipelines' own step index.

``set_step`` gives the step of the calls a loop of one's own makes outside any
``cache_context``; inside one (every diffusers pipeline call) the context's step index,
or the step counted from the timesteps, is the step: a hand-set step left over from an
earlier loop never overrides a later pipeline (it used to: with ``skip_first_steps=2`` and
4 steps, every step ran sparse). Called inside a context, ``set_step`` sets that
context's step until it exits; as a context manager it gives the previous step back.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ditops
from ditops.attention.schedule import BlockSparseConfig
from tests.integrations import test_diffusers_hunyuan_video as hv_t
from tests.integrations import test_diffusers_wan as wan_t

CFG = BlockSparseConfig(sparsity=0.25, skip_first_steps=2, block_size=32, stride=4)


def _count_sparse_calls(model: nn.Module) -> list[int]:
    """A live count of the calls that reach a sparse attention layer's sparse path."""
    from ditops.layers.sparse_attention import BlockSparseAttention

    calls = [0]
    for module in model.modules():
        processor = getattr(module, "processor", None)
        sparse = getattr(processor, "sparse", None)
        if isinstance(sparse, BlockSparseAttention):
            original = sparse._block_mask

            def counted(*a, _original=original, **k):
                calls[0] += 1
                return _original(*a, **k)

            sparse._block_mask = counted
    return calls


def _wan_pipeline(model: nn.Module, x: dict, steps: int = 4) -> list[torch.Tensor]:
    """What WanPipeline does: cond then uncond per step, inside cache_context(step_index)."""
    outs = []
    for i in range(steps):
        for name in ("cond", "uncond"):
            with torch.inference_mode(), model.cache_context(name, step_index=i):
                outs.append(model(**x, return_dict=False)[0])
    return outs


def test_a_hand_set_step_does_not_override_a_later_pipeline() -> None:
    model = wan_t.tiny_wan(keep_fp32=False)
    x = wan_t.inputs(frames=4, hw=16)
    ditops.patch(model, attention=CFG)
    calls = _count_sparse_calls(model)
    fresh = _wan_pipeline(model, x)
    assert calls[0] == 2 * 2 * 2  # steps 2 and 3, cond and uncond, 2 layers
    calls[0] = 0
    with torch.inference_mode():  # a loop of one's own, as the README shows
        for i in range(4):
            ditops.set_step(model, i)
            model(**x, return_dict=False)
    assert calls[0] == 2 * 2  # steps 2 and 3, 2 layers
    calls[0] = 0
    after = _wan_pipeline(model, x)
    assert calls[0] == 8  # the pipeline's own step index, not the step left at 3
    assert all(torch.equal(a, b) for a, b in zip(after, fresh, strict=True))
    # outside any context the hand-set step still holds
    with torch.inference_mode():
        model(**x, return_dict=False)
    assert calls[0] == 8 + 2


def test_a_hand_set_step_does_not_override_steps_counted_from_timesteps() -> None:
    """HunyuanVideoPipeline enters cache_context(name) without a step index: its steps are
    counted from the timesteps, and a step left by set_step does not override them."""
    model = hv_t.tiny_hunyuan(num_layers=1, num_single_layers=1)
    ditops.patch(model, attention=CFG)
    x = hv_t.inputs(frames=4, hw=16)
    calls = _count_sparse_calls(model)
    ditops.set_step(model, 3)
    for i in range(4):
        hv_t.run(model, "cond", **{**x, "timestep": torch.tensor([900 - 100 * i])})
    assert calls[0] == 2 * 2  # steps 2 and 3, 2 layers


def test_set_step_inside_a_context_and_as_a_context_manager() -> None:
    model = wan_t.tiny_wan(keep_fp32=False)
    ditops.patch(model, attention=CFG)
    steps = model._ditops_steps
    with model.cache_context("cond", step_index=0):
        assert steps.current() == 0
        ditops.set_step(model, 5)  # inside a context: that context's step
        assert steps.current() == 5
    assert steps.current() is None and steps.manual is None
    with ditops.set_step(model, 1):
        assert steps.current() == 1
        with ditops.set_step(model, 2):
            assert steps.current() == 2
        assert steps.current() == 1
    assert steps.current() is None
    ditops.set_step(model, 4)
    with model.cache_context("cond", step_index=1):
        assert steps.current() == 1
    assert steps.current() == 4
    with pytest.raises(ValueError, match="step must be an int >= 0 or None"):
        ditops.set_step(model, -1)
    assert steps.current() == 4  # a refused step changes nothing
    ditops.set_step(model, None)
    assert steps.current() is None


def test_a_hand_set_step_not_used_inside_a_context_says_so_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A loop of one's own that enters cache_context("cond") without a step index and sets
    the step outside it: the context's counted step is used, and ditops says so once."""
    model = wan_t.tiny_wan(keep_fp32=False)
    ditops.patch(model, attention=CFG)
    x = wan_t.inputs(frames=4, hw=16)
    ditops.set_step(model, 3)
    with caplog.at_level("WARNING", logger="ditops"):
        for _ in range(2):
            with torch.inference_mode(), model.cache_context("cond"):
                model(**x, return_dict=False)
    said = [r for r in caplog.records if "set_step (3) holds for calls outside" in r.message]
    assert len(said) == 1 and "counted from its timesteps (0)" in said[0].getMessage()
