"""Checks the FLUX.2 and Mochi tests share besides ``lifecycle``'s: a refusal that changes
nothing, steps under a cache context."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import ditops
from ditops.integrations import PatchError


def assert_refused_whole(
    model: nn.Module, run: Callable[..., torch.Tensor], x: dict, fragment: str, **options: Any
) -> None:
    """``patch(model, **options)`` raises naming ``fragment`` and changes nothing: no
    record, no forward on the first block, the same output."""
    ref = run(model, **x)
    with pytest.raises(PatchError, match=fragment):
        ditops.patch(model, **options)
    assert not hasattr(model, "_ditops_patch")
    assert "forward" not in vars(model.transformer_blocks[0])
    assert torch.equal(run(model, **x), ref)


def cached_steps(model: nn.Module, x: dict, timesteps: list[torch.Tensor]) -> list[torch.Tensor]:
    """One output per timestep, each call in ``cache_context("cond", step_index=i)``."""
    outs = []
    with torch.inference_mode():
        for i, t in enumerate(timesteps):
            with model.cache_context("cond", step_index=i):
                outs.append(model(**{**x, "timestep": t}, return_dict=False)[0])
    return outs
