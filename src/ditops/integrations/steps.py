"""Knowing the denoising step from inside a diffusers model.

diffusers pipelines run every transformer call inside ``model.cache_context(name,
step_index=i, ...)`` (twice per step under classifier-free guidance: "cond", then
"uncond"). The context reaches the stateful hooks registered on the model, so a hook
with a ``StateManager`` sees ``step_index`` before every forward: the same index for both
guidance calls, and a fresh count for each pipeline call. :class:`StepTracker` is such a
hook; it writes the step into a :class:`StepState` that ditops' attention processors read.

Outside a pipeline, wrap calls in ``model.cache_context("cond", step_index=i)`` yourself,
or call :func:`set_step`. With no step known, the schedule treats the call as dense
(never sparse by accident).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

HOOK_NAME = "ditops_step_tracker"


@dataclass
class StepState:
    """What the attention processors need to know about the call in progress.

    ``step``: the denoising step from the pipeline's cache context (``None``: unknown);
    ``manual``: one set with :func:`set_step`, which wins; ``latent_shape``: the shape of
    the latent video entering the model (for the first frame's dense blocks);
    ``patch_size``: the model's patch size.
    """

    step: int | None = None
    manual: int | None = None
    latent_shape: tuple[int, ...] | None = None
    patch_size: tuple[int, ...] = (1, 2, 2)

    def current(self) -> int | None:
        return self.manual if self.manual is not None else self.step


class _NoState:
    """StateManager wants a state class; the tracker keeps its state elsewhere."""

    def reset(self, *args: Any, **kwargs: Any) -> None:
        pass


def attach_step_tracker(model: nn.Module, state: StepState) -> None:
    """Register the step-tracking hook on ``model`` (once)."""
    from diffusers.hooks.hooks import HookRegistry, ModelHook, StateManager

    class StepTracker(ModelHook):
        _is_stateful = True

        def __init__(self) -> None:
            super().__init__()
            # Found by diffusers' cache_context through vars(hook): it sets .context on it.
            self.state_manager = StateManager(_NoState)

        def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            ctx = self.state_manager._context
            state.step = None if ctx is None else ctx.step_index
            latents = kwargs.get("hidden_states", args[0] if args else None)
            if isinstance(latents, torch.Tensor) and latents.dim() == 5:
                state.latent_shape = tuple(latents.shape)
            return args, kwargs

        def reset_state(self, module: nn.Module) -> nn.Module:
            state.step = None
            return module

    registry = HookRegistry.check_if_exists_or_initialize(model)
    if registry.get_hook(HOOK_NAME) is None:
        registry.register_hook(StepTracker(), HOOK_NAME)


def detach_step_tracker(model: nn.Module) -> None:
    registry = getattr(model, "_diffusers_hook", None)
    if registry is not None and registry.get_hook(HOOK_NAME) is not None:
        registry.remove_hook(HOOK_NAME, recurse=False)


def set_step(model: nn.Module, step: int | None) -> None:
    """Set the denoising step by hand for a patched model (``None``: follow the pipeline)."""
    state = getattr(model, "_ditops_steps", None)
    if state is None:
        raise ValueError(
            "set_step: this model was not patched with sparse attention by ditops.patch"
        )
    if step is not None and (not isinstance(step, int) or step < 0):
        raise ValueError(f"set_step: step must be an int >= 0 or None, got {step!r}")
    state.manual = step
