"""Video self-attention, block-sparse on sparse steps, for models whose latents enter
already packed into tokens (LTX-Video, LTX-2).

Wan and HunyuanVideo take the latent video ``[B, C, F, H, W]`` and patchify it inside the
model, so :class:`~ditops.integrations.shared.steps.LatentShapeRecorder` reads the video's
shape from ``hidden_states``. LTX's pipelines pack the latents before the call (tokens in
``(frame, height, width)`` order) and pass the grid as ``num_frames``, ``height`` and
``width`` (or only the tokens' ``video_coords``): :class:`GridRecorder` records it from
those arguments, and counts the denoising step from the call's timestep by the
parameter's name (LTX's pipelines enter ``cache_context("cond_uncond")`` without a step
index). A family declares it as its ``Sparse.recorder``
(:func:`grid_recorder`), installed with the sparse attention.

:class:`VideoSelfAttention` is the attention a family's self-attention processor runs
once it has ``q``, ``k``, ``v`` (``[B, S, H, D]``): dense as diffusers dispatches it (the
wrapped processor's backend and context-parallel config), or ditops'
:class:`~ditops.layers.sparse_attention.BlockSparseAttention` on the sparse steps with the
first frame's blocks dense; under diffusers' context parallelism sparse steps exchange
q/k/v so each rank attends over the whole sequence for its heads (as Wan's processor).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch
from torch import nn

from ditops.integrations.shared.parallel import (
    attend_across_ranks,
    check_method_per_rank,
    context_parallel_of,
)
from ditops.integrations.shared.processors import WrappingProcessor
from ditops.integrations.shared.steps import StepState, runs_dense
from ditops.tracing import refuse_under_fullgraph, traced

logger = logging.getLogger("ditops")

#: The arguments naming the token grid of a packed video, in LTX's spelling.
GRID = ("num_frames", "height", "width")


class GridRecorder:
    """Forward pre-hook of a model taking packed tokens: the call's latent grid into
    ``state.latent_shape`` (``(B, 0, F, H, W)``: from ``num_frames``/``height``/``width``,
    else from the tokens' coordinates (:func:`grid_of_coords`, eager calls only); None
    when neither gives one) and, when the call brings no step index, the step counted from
    its timestep (``StepState.count``). Arguments are read by name, positional ones too
    (``params``: the names of the model's forward parameters after ``self``)."""

    def __init__(
        self,
        state: StepState,
        params: tuple[str, ...],
        grid: tuple[str, ...] = GRID,
        tokens: str = "hidden_states",
        timestep: str = "timestep",
        coords: str = "video_coords",
    ) -> None:
        self.state = state
        self.params = params
        self.grid = grid
        self.tokens = tokens
        self.timestep = timestep
        self.coords = coords

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        given = dict(zip(self.params, args))
        given.update(kwargs)
        tokens = given.get(self.tokens)
        sizes = [given.get(name) for name in self.grid]
        coords = given.get(self.coords)
        shape = None
        if isinstance(tokens, torch.Tensor) and all(isinstance(s, int) for s in sizes):
            shape = (int(tokens.shape[0]), 0, *sizes)
        elif isinstance(tokens, torch.Tensor) and isinstance(coords, torch.Tensor):
            if not traced():  # host reads: under a trace the grid stays unknown
                shape = grid_of_coords(coords, int(tokens.shape[0]), self.state.patch_size)
        self.state.latent_shape = shape
        if self.state.step is not None:
            return
        if traced():
            refuse_under_fullgraph(
                f"ditops: {type(module).__name__} with sparse attention counts its denoising "
                "steps from the timestep when a call brings no step index (a host read, a "
                "graph break), so it cannot compile with fullgraph=True. Give the step "
                "(model.cache_context(name, step_index=i) around each call), or compile "
                "with fullgraph=False."
            )
        timestep = given.get(self.timestep)
        if isinstance(timestep, torch.Tensor) and timestep.numel():
            self.state.count(float(timestep.float().mean()))
        else:
            self.state.counted = None


def grid_of_coords(
    coords: torch.Tensor, batch: int, patch: tuple[int, ...]
) -> tuple[int, ...] | None:
    """The latent grid ``(B, 0, F, H, W)`` of tokens whose coordinates ``coords`` are
    ``[B, 3, S]`` (LTX: frame, row, column of each token) or ``[B, 3, S, 2]`` (LTX-2: each
    patch's bounds), in ``(frame, height, width)`` order: the frames counted, the first
    frame's tokens the leading run of the first token's frame, its rows counted. None when
    those do not make a grid (three host reads)."""
    c = coords[0] if coords.dim() == 3 else coords[0, ..., 0]
    if c.dim() != 2 or c.shape[0] != 3 or c.shape[1] == 0:
        return None
    frame = c[0]
    first = int((frame != frame[0]).int().argmax()) or int(frame.numel())
    frames = int(torch.unique(frame).numel())
    rows = int(torch.unique(c[1, :first]).numel())
    cols = first // rows
    if rows * cols != first:
        return None
    pt, ph, pw = patch[-3:]
    return (batch, 0, frames * pt, rows * ph, cols * pw)


def grid_recorder(steps: StepState, model: nn.Module) -> GridRecorder:
    """The :class:`GridRecorder` of a packed-token model (``Sparse.recorder``): arguments
    read by the names of its forward's parameters."""
    params = tuple(inspect.signature(type(model).forward).parameters)[1:]
    return GridRecorder(steps, params)


def split_rotary(attn: nn.Module) -> str | None:
    """A self-attention over split rotary tables (LTX-2's checkpoints) runs diffusers'
    prologue: the op takes one table for all heads, split's differ per head
    (``Attention.as_diffusers``)."""
    return None if getattr(attn, "rope_type", "interleaved") == "interleaved" else "split rotary"


class VideoSelfAttention(WrappingProcessor):
    """Base of a packed-video self-attention processor: ``cls(original, ops=..., steps=...,
    sparse=...)`` and :meth:`attend` (see the module docstring). ``ops`` None (built by a
    loader, or ``norms=False``): the subclass runs diffusers' prologue."""

    #: Whether sparse steps run under diffusers' context parallelism (the family's
    #: ``Sparse.context_parallel``).
    context_parallel = True

    def own_attention(self) -> bool:
        """Whether :meth:`attend` computes this call's attention itself (a sparse step, or
        any step under Ring attention with sparsity: the exchange is ditops' then);
        otherwise dense attention is diffusers' ``dispatch_attention_fn`` as the wrapped
        processor calls it, and without a fused prologue the original runs whole."""
        if not runs_dense(self.sparse, self.steps):
            return True
        cp = context_parallel_of(self._parallel_config)
        return self.sparse is not None and cp is not None and cp.ring_degree > 1

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Self-attention of ``[B, S, H, D]`` q/k/v (this rank's sequence shard under
        context parallelism), ``[B, S, H, D]`` out."""
        if not self.own_attention():
            return self._dispatch_dense(q, k, v)
        dense = runs_dense(self.sparse, self.steps)
        attend = self._dense if dense else self._sparse
        cp = context_parallel_of(self._parallel_config)
        if cp is None:
            return attend(q, k, v)
        if not self.context_parallel:  # enabled after the patch (the patch refuses it)
            raise NotImplementedError(
                f"ditops: sparse attention under context parallelism is not supported by "
                f"{type(self).__name__}; patch with attention=None"
            )
        if not dense:
            check_method_per_rank(self.sparse.config.method)  # type: ignore[union-attr]
        return attend_across_ranks(cp, q, k, v, attend)

    def _dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        return dispatch_attention_fn(
            q, k, v, dropout_p=0.0, is_causal=False, backend=self._attention_backend
        )

    def _sparse(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Estimate + block-sparse attention over the whole sequence, the first frame's
        blocks dense when the call's grid is known and matches the sequence."""
        assert self.sparse is not None and self.steps is not None
        return self.sparse(
            q,
            k,
            v,
            layout="BSND",
            step=self.steps.current(),
            branch=self.steps.branch,
            dense_blocks=self.first_frame_blocks(int(q.shape[1])),
        )

    def first_frame_blocks(self, tokens: int) -> int | None:
        """The blocks covering the first frame, from the recorded grid and the model's
        patch size; None (and a warning, once) when the call gave no grid or the grid does
        not make ``tokens`` tokens."""
        from ditops.attention.schedule import first_frame_dense_blocks

        assert self.steps is not None and self.sparse is not None
        shape, patch = self.steps.latent_shape, self.steps.patch_size
        if shape is not None:
            grid = [s // p for s, p in zip(shape[-3:], patch[-3:])]
            if grid[0] * grid[1] * grid[2] == tokens:
                return first_frame_dense_blocks(shape, patch, self.sparse.config.block_size)
        warn_once(
            f"ditops: {type(self).__name__}: a sparse step whose call gives no (num_frames, "
            "height, width) grid of its tokens (conditioning tokens added to the video, or "
            "coordinates under torch.compile) runs without the first frame's blocks kept "
            "dense"
        )
        return None


_WARNED: set[str] = set()


def warn_once(message: str) -> None:
    """Log ``message`` (WARNING, ``ditops``) once per process."""
    if message not in _WARNED and not traced():
        _WARNED.add(message)
        logger.warning(message)
