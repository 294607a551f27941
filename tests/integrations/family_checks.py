"""Checks the model-family tests share (FLUX.2, Mochi): a diffusers function given another
source, a refusal that changes nothing, steps under a cache context, a fresh process."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import ditops
from ditops import config
from ditops.custom_op import reset_state
from ditops.integrations import PatchError


def change_source(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> None:
    """Give ``owner.name`` another source (so another fingerprint), same behaviour."""
    original = getattr(owner, name)

    def changed(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, changed)


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


@pytest.fixture
def fresh_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """As in a fresh process: no op plans, no process config, dynamo reset."""
    reset_state()
    monkeypatch.setattr(config, "_process", None)
    torch._dynamo.reset()
    yield
    reset_state()


def on_triton_paths(
    monkeypatch: pytest.MonkeyPatch, ops: tuple[type, ...], call: Callable[[], torch.Tensor]
) -> tuple[dict[str, int], torch.Tensor]:
    """``call()`` with every op on its Triton path (CPU tensors through Triton's
    interpreter, dispatched as CUDA; strict: a fall back raises): the calls reaching each
    of ``ops``' ``forward_cuda``, and the output."""
    from tests.integrations.spies import install_spies

    reset_state()
    try:
        with ditops.force_device_kind({"cpu": "cuda"}), config.override(strict=True):
            used = install_spies(monkeypatch, ops, "forward_cuda")
            out = call()
    finally:
        reset_state()
    return used, out
