"""Knowing the denoising step (and guidance branch) from inside a diffusers model.

diffusers pipelines run every transformer call inside ``model.cache_context(name,
step_index=i, ...)`` (twice per step under classifier-free guidance: "cond", then
"uncond"), and a fresh count for each pipeline call. :func:`track_steps` puts a
``cache_context`` on the model instance that first writes the step and the branch name
into a :class:`StepState`, then runs the model's own ``cache_context`` (so diffusers'
cache hooks still receive it); ditops' attention processors read the state. A forward
pre-hook records the latent video's shape (for the first frame's dense blocks).

Both are plain objects, not closures and not diffusers hooks (whose wrappers close over
the original module): a deep copy of the model tracks its own steps, and it pickles.

Outside a pipeline, wrap calls in ``model.cache_context("cond", step_index=i)`` yourself,
or call :func:`set_step`. With no step known, the schedule treats the call as dense
(never sparse by accident). A step set with :func:`set_step` is the step of the calls
made *outside* any ``cache_context`` (a loop of one's own); inside one, the context's step
index (or the counted step) is the step, so a step left over from such a loop never
overrides a later pipeline call. :func:`set_step` called inside a context sets that
context's step until it exits.

Some pipelines (``HunyuanVideoPipeline``, ``HunyuanVideo15Pipeline`` in diffusers 0.42)
enter ``cache_context(name)`` without a step index. For their families the state counts
steps itself (``count_steps``): per branch, a call whose timestep is below the branch's
previous one is the next step, any other call starts a new count at 0 (a new pipeline
call: their schedulers' timesteps fall strictly within one). A call's timestep is the mean
of those it brings (one per sample, or per frame under SkyReels-V2's diffusion forcing,
where the mean falls at every iteration of a segment and a new segment counts from 0).
So do the Wan-derived models' pipelines (VACE, SkyReels-V2, ChronoEdit, Wan-Animate). A
step index given (the context's, or :func:`set_step`'s inside the context) wins.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ditops.core.checks import as_int
from ditops.integrations.shared.undo import AttrSet, PatchRecord, TorchHook
from ditops.tracing import refuse_under_fullgraph, traced

logger = logging.getLogger("ditops")


class _PerThread:
    """An attribute whose value is the calling thread's own (``None`` until it sets one)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj._local, self.name, None)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj._local, self.name, value)


class StepState:
    """What the attention processors need to know about the call in progress.

    ``step``/``branch``: the denoising step and the cache context's name ("cond",
    "uncond") of the call in progress (``None``: unknown); ``latent_shape``: the shape of
    the latent video entering the model. These three are the calling thread's own: threads
    that share one patched model each run their own denoising loop, and a thread at step 0
    must not run sparse because another is at step 20. ``manual``: a step set with
    :func:`set_step` outside any ``cache_context``: the step of every thread's calls made
    outside one (inside one, the context's step or the counted one is the step);
    ``patch_size``: the model's patch size.

    A deep copy or a pickle carries ``manual`` and ``patch_size`` only (no call is in
    progress in a copy).
    """

    def __init__(self, patch_size: tuple[int, ...] = (1, 2, 2), count_steps: bool = False) -> None:
        self.manual: int | None = None
        self.said = False  # the warning of current() given
        self.patch_size = patch_size
        self.count_steps = count_steps  # count steps from timesteps (see the module docstring)
        self._local = threading.local()

    step = _PerThread()
    branch = _PerThread()
    latent_shape = _PerThread()
    counted = _PerThread()  # the step counted from timesteps (count_steps)
    inside = _PerThread()  # True while the thread is inside a cache_context

    def current(self) -> int | None:
        if self.step is not None:  # the context's step index (or set_step's inside it)
            return self.step
        if self.manual is not None:
            if not self.inside:
                return self.manual
            if not self.said and not traced():
                self.said = True  # once: a pipeline after a loop of one's own meets this
                logger.warning(
                    "ditops: the step set with set_step (%s) holds for calls outside "
                    "cache_context; this call inside cache_context(%r) brings no step index "
                    "and takes the step counted from its timesteps (%s). Call set_step inside "
                    "the context to set its step, or set_step(model, None) to clear yours.",
                    self.manual,
                    self.branch,
                    self.counted,
                )
        return self.counted

    def count(self, timestep: float) -> None:
        """Count the step of a call with this timestep (see the module docstring); per
        thread, like the step."""
        seen: dict[str | None, tuple[float, int]] = self._local.__dict__.setdefault("seen", {})
        last = seen.get(self.branch)
        step = last[1] + 1 if last is not None and timestep < last[0] else 0
        seen[self.branch] = (timestep, step)
        self.counted = step

    def __getstate__(self) -> dict[str, Any]:
        return {"manual": self.manual, "patch_size": self.patch_size, "count": self.count_steps}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["patch_size"], state.get("count", False))  # type: ignore[misc]
        self.manual = state["manual"]

    def __deepcopy__(self, memo: dict[int, Any]) -> StepState:
        twin = StepState(self.patch_size, self.count_steps)
        twin.manual = self.manual
        return twin


class StepTrackingCacheContext:
    """``model.cache_context`` that tells a :class:`StepState` the step first.

    Then it enters what ``model.cache_context`` was before (the class's method, or an
    instance attribute someone set earlier).
    """

    def __init__(self, model: nn.Module, state: StepState, inner: Any) -> None:
        self.model = model
        self.state = state
        self.inner = inner

    def __call__(self, name: str, **kwargs: Any) -> contextlib.AbstractContextManager[None]:
        return self._enter(name, kwargs)

    @contextlib.contextmanager
    def _enter(self, name: str, kwargs: dict[str, Any]) -> Iterator[None]:
        state = self.state
        saved = (state.step, state.branch, state.inside)
        step = kwargs.get("step_index")
        state.step = int(step) if step is not None else None
        state.branch = name
        state.inside = True
        inner = self.inner
        if inner is None:
            inner = type(self.model).cache_context.__get__(self.model)  # type: ignore[attr-defined]
        try:
            with inner(name, **kwargs):
                yield
        finally:
            state.step, state.branch, state.inside = saved


class LatentShapeRecorder:
    """Forward pre-hook: the shape of the 5-D latent video a call brings (and, for a
    state that counts steps, the call's timestep)."""

    def __init__(self, state: StepState) -> None:
        self.state = state

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        latents = kwargs.get("hidden_states", args[0] if args else None)
        if isinstance(latents, torch.Tensor) and latents.dim() == 5:
            self.state.latent_shape = tuple(latents.shape)
        timestep = kwargs.get("timestep", args[1] if len(args) > 1 else None)
        # Count only calls that came without a step index (one host read of the timestep).
        if self.state.count_steps and self.state.step is None:
            if traced():
                refuse_under_fullgraph(
                    f"ditops: {type(module).__name__} with sparse attention counts its "
                    "denoising steps from the timestep when a call brings no step index (a "
                    "host read, a graph break), so it cannot compile with fullgraph=True. "
                    "Give the step (model.cache_context(name, step_index=i) around each "
                    "call), or compile with fullgraph=False."
                )
            if isinstance(timestep, torch.Tensor) and timestep.numel():
                self.state.count(float(timestep.float().mean()))
            else:
                self.state.counted = None


def track_steps(model: nn.Module, state: StepState, record: PatchRecord) -> None:
    """Make ``model`` report its denoising step and latent shape into ``state``."""
    if not hasattr(type(model), "cache_context"):
        return  # not a diffusers CacheMixin: steps come from set_step only
    inner = vars(model).get("cache_context")
    record.add(AttrSet.apply(model, "cache_context", StepTrackingCacheContext(model, state, inner)))
    record.add(TorchHook.register(model, LatentShapeRecorder(state)))
    record.add(AttrSet.apply(model, "_ditops_steps", state))


class StepScope:
    """What :func:`set_step` returns: the step is set already; used as a context manager,
    the step in force before comes back on exit."""

    def __init__(self, state: StepState, attr: str, previous: int | None) -> None:
        self._state = state
        self._attr = attr
        self._previous = previous

    def __enter__(self) -> StepScope:
        return self

    def __exit__(self, *exc: object) -> None:
        setattr(self._state, self._attr, self._previous)


def set_step(model: nn.Module, step: int | None) -> StepScope:
    """Set the denoising step by hand for a model patched with sparse attention.

    For a loop of your own that does not use ``model.cache_context``: the step holds for
    the calls made outside any ``cache_context`` (from every thread) until the next
    ``set_step``; ``None`` clears it (the step is then unknown: dense while
    ``skip_first_steps`` > 0). Inside a ``cache_context`` (every diffusers pipeline
    call) the context's own step index, or the step ditops counts from the timesteps
    for pipelines that give none, is the step, so a step left over from your loop never
    overrides a later pipeline call (ditops warns once when a call inside a context
    brings no step index while a hand-set step is in force). Called inside a
    ``cache_context``, it sets that context's step (for the calling thread) until the
    context exits.

    Also a context manager: ``with ditops.set_step(model, i): model(...)`` gives the step
    in force before back on exit.

    Args:
        model: a model patched by ``ditops.patch(model, attention=...)``.
        step: an int >= 0 (any integer type: ``operator.index``; not a bool), or None.
    """
    state = getattr(model, "_ditops_steps", None)
    if state is None:
        raise ValueError(
            "set_step: this model was not patched with sparse attention by ditops.patch "
            "(patch(model, attention=ditops.BlockSparseConfig(...)) first)"
        )
    value = None if step is None else as_int(step)
    if step is not None and (value is None or value < 0):
        raise ValueError(f"set_step: step must be an int >= 0 or None, got {step!r}")
    attr = "step" if state.inside else "manual"
    scope = StepScope(state, attr, getattr(state, attr))
    setattr(state, attr, value)
    return scope


def runs_dense(sparse: nn.Module | None, steps: StepState | None) -> bool:
    """Whether an attention call now runs dense: no sparse attention or step state, a dense
    step of ``sparse``'s schedule, or the step unknown while the schedule starts dense
    (never sparse by accident)."""
    if sparse is None or steps is None:
        return True
    sparse.check_fullgraph()  # type: ignore[operator]  # refused on dense steps too
    cfg = sparse.config
    step = steps.current()
    if step is None and cfg.skip_first_steps > 0:
        return True
    return bool(cfg.dense_at(step))
