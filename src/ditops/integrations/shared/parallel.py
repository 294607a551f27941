"""ditops under diffusers' context parallelism: the exchange around sparse attention.

diffusers (0.36+) runs a model on several devices with ``ContextParallelConfig(
ulysses_degree=U, ring_degree=R)`` applied by ``model.enable_parallelism(config=...)`` or
``from_pretrained(..., parallel_config=...)``. Hooks split the sequence at the model's
input (its ``_cp_plan``; Wan: at ``blocks.0`` and the rotary embedding) across the
``P = R * U`` ranks of diffusers' flattened ``ring x ulysses`` mesh, in rank order, and
gather it at the output. Inside attention, its processors exchange q/k/v through
``dispatch_attention_fn(..., parallel_config=...)``; ``enable_parallelism`` writes the
config into every processor that has a ``_parallel_config`` attribute.

What ditops installs, under that split:

* fused norms / modulation / residuals work token by token: nothing to exchange;
* sparse self-attention (Wan's :class:`~ditops.integrations.wan.attention.WanSelfAttnProcessor`)
  needs, per head, the whole sequence: the estimate scores every query block against
  every key block, and the first frame's dense blocks are counted from the whole video.
  So on a sparse step it moves q/k/v from sequence shards to head shards,
  ``[B, S/P, H, D] -> [B, S, H/P, D]`` (:func:`heads_from_sequence`, one all-to-all),
  runs the estimate and block-sparse attention on its heads (the masks one process
  computes for those heads), and moves the output back (:func:`sequence_from_heads`).

Which group, and the dense steps:

* Ulysses (``ring_degree == 1``): the exchange runs on diffusers' Ulysses group. Dense
  steps run diffusers' own processor with the config (its own Ulysses all-to-all), so
  they are what the unpatched model computes under Ulysses.
* Ring and unified (``ring_degree > 1``): instead of passing K/V around the ring, ditops
  exchanges heads across the whole context-parallel group (the flattened mesh, the one
  that split the sequence), at every step; dense steps then run diffusers' attention
  backend without a parallel config on the whole sequence of the local heads. Why: the
  estimate needs every key block of a row at once (a ring sees one shard at a time) and
  the block-sparse kernels return no log-sum-exp to merge shards with. Cost per rank and
  attention call, with ``n = B * S/P * H * D`` elements in each of the local q, k, v:
  sends and receives ``4 n (P-1)/P`` (q, k, v and the output) and holds ``3 n`` after
  the exchange; diffusers' Ring all-gathers K/V: receives ``2 n (P-1)`` and holds
  ``2 n P``. A side effect: ditops runs Ring on CPU, where diffusers' native backend
  refuses it (it needs the log-sum-exp).

Support matches diffusers' where diffusers supports it: sequence lengths must divide
evenly among the ranks unless the config sets ``ulysses_anything`` / ``ring_anything``
(diffusers' split refuses otherwise, before any attention runs), and under Ulysses the
heads must divide evenly among the ranks unless ``ulysses_anything`` is set (diffusers'
Ulysses attention cannot split them either). With an "anything" config, or under Ring,
heads and lengths may split unevenly (the first ranks take one more head; a rank left
without heads computes nothing but still takes part in the exchange).

Only inference: the exchange has no backward (a call that needs gradients is refused).
The same code runs on every device kind: torch.distributed's all-to-all on the process
groups of diffusers' mesh, whatever their backend (gloo, nccl, hccl).

:func:`cpu_shims` holds the two work-arounds diffusers 0.42 needs to run its context
parallelism on a host without an accelerator (CPU + gloo).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ditops.attention.methods import METHODS

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def context_parallel_of(parallel_config: Any) -> Any | None:
    """The ``ContextParallelConfig`` in force, or ``None`` (one device).

    diffusers hands processors a ``ParallelConfig`` holding it; a ``ContextParallelConfig``
    itself is taken too.
    """
    if parallel_config is None:
        return None
    cp = getattr(parallel_config, "context_parallel_config", parallel_config)
    if cp is None or not hasattr(cp, "ulysses_degree"):
        return None
    if (cp.ulysses_degree or 1) * (cp.ring_degree or 1) <= 1:
        return None
    return cp


@dataclass(frozen=True)
class Shards:
    """How a sequence is spread over a group before the exchange, heads after it.

    ``seq[j]``: tokens rank ``j`` holds (in rank order, as diffusers' split gave them);
    ``heads[j]``: heads rank ``j`` holds after :func:`heads_from_sequence`.
    """

    group: Any
    rank: int
    seq: tuple[int, ...]
    heads: tuple[int, ...]


def split_sizes(total: int, parts: int) -> tuple[int, ...]:
    """``total`` split into ``parts`` as ``torch.tensor_split`` does (first ones larger)."""
    base, extra = divmod(total, parts)
    return tuple(base + (i < extra) for i in range(parts))


def plan_shards(cp: Any, local_len: int, heads: int, device: torch.device) -> Shards:
    """The :class:`Shards` of this call under the (set up) context-parallel config ``cp``."""
    import torch.distributed as dist

    ring = cp.ring_degree > 1
    mesh = cp._flattened_mesh if ring else cp._ulysses_mesh
    if mesh is None:
        raise RuntimeError(
            "ditops: the context-parallel config has no device mesh; apply it with "
            "model.enable_parallelism(config=...) or from_pretrained(..., parallel_config=...)"
        )
    group = mesh.get_group()
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    uneven = bool(cp.ulysses_anything or cp.ring_anything)
    if not ring and not uneven and heads % world:
        raise ValueError(
            f"ditops sparse attention under Ulysses: ulysses_degree {world} does not divide "
            f"the {heads} attention heads (diffusers' Ulysses attention needs it too); use a "
            "degree that divides them, or ContextParallelConfig(..., ulysses_anything=True)"
        )
    if uneven:
        # Shards may differ in length: every rank says how many tokens it holds.
        mine = torch.tensor([local_len], dtype=torch.int64, device=device)
        every = torch.empty(world, dtype=torch.int64, device=device)
        dist.all_gather_into_tensor(every, mine, group=group)
        seq = tuple(int(n) for n in every.tolist())
    else:
        seq = (local_len,) * world
    return Shards(group, rank, seq, split_sizes(heads, world))


def _all_to_all(parts: list[torch.Tensor], recv_sizes: list[int], group: Any) -> torch.Tensor:
    """Send ``parts[j]`` to rank ``j`` of ``group``; returns, flat and in rank order, the
    ``recv_sizes[j]`` elements rank ``j`` sent here."""
    import torch.distributed as dist

    send_sizes = [p.numel() for p in parts]
    send = parts[0].new_empty(sum(send_sizes))
    for part, buf in zip(parts, send.split(send_sizes)):
        buf.view(part.shape).copy_(part)
    recv = parts[0].new_empty(sum(recv_sizes))
    dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group)
    return recv


def heads_from_sequence(x: torch.Tensor, shards: Shards) -> torch.Tensor:
    """``[B, seq[rank], H, D]`` -> ``[B, sum(seq), heads[rank], D]`` (one all-to-all)."""
    b, _, _, d = x.shape
    mine = shards.heads[shards.rank]
    recv_sizes = [b * n * mine * d for n in shards.seq]
    recv = _all_to_all(list(x.split(shards.heads, dim=2)), recv_sizes, shards.group)
    total = sum(shards.seq)
    if b == 1:  # the received shards are the whole sequence, in order, already
        return recv.view(1, total, mine, d)
    parts = [buf.view(b, n, mine, d) for buf, n in zip(recv.split(recv_sizes), shards.seq)]
    return torch.cat(parts, dim=1)


def sequence_from_heads(y: torch.Tensor, shards: Shards) -> torch.Tensor:
    """``[B, sum(seq), heads[rank], D]`` -> ``[B, seq[rank], sum(heads), D]`` (one all-to-all)."""
    b, _, _, d = y.shape
    s = shards.seq[shards.rank]
    recv_sizes = [b * s * h * d for h in shards.heads]
    recv = _all_to_all(list(y.split(shards.seq, dim=1)), recv_sizes, shards.group)
    out = y.new_empty(b, s, sum(shards.heads), d)
    for part, buf, h in zip(out.split(shards.heads, dim=2), recv.split(recv_sizes), shards.heads):
        part.copy_(buf.view(b, s, h, d))
    return out


def check_method_per_rank(method: str) -> None:
    """Raise a ValueError when the estimate ``method`` needs every head of a layer at
    once: under context parallelism each rank estimates the heads it holds, so such a
    mask would differ from one process's (nothing runs before the refusal)."""
    if METHODS[method][1] == "layer":
        per_rank = [m for m, (_, alloc) in METHODS.items() if alloc != "layer"]
        raise ValueError(
            f"ditops sparse attention under context parallelism: method {method!r} spends "
            "one budget over all heads of a layer, but each rank holds some of the heads; "
            f"use one of {per_rank} (their masks equal one process's)"
        )


def attend_across_ranks(
    cp: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attend: Attend
) -> torch.Tensor:
    """Self-attention of sequence shards ``[B, S/P, H, D]`` with ``attend`` on head shards.

    ``attend(q, k, v)`` gets ``[B, S, H/P, D]`` tensors (layout BSND) and returns the
    output in the same layout; the result is this rank's ``[B, S/P, H, D]`` shard.
    """
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise RuntimeError(
            "ditops sparse attention under context parallelism is inference only (its "
            "exchange has no backward); run it under torch.inference_mode() or "
            "torch.no_grad(), or patch with attention=None to train"
        )
    shards = plan_shards(cp, int(q.shape[1]), int(q.shape[2]), q.device)
    qh, kh, vh = (heads_from_sequence(t, shards) for t in (q, k, v))
    if shards.heads[shards.rank]:
        out = attend(qh, kh, vh)
    else:  # more ranks than heads: nothing to compute here, the exchange still runs
        out = vh.new_empty(vh.shape)
    return sequence_from_heads(out, shards)


# --- CPU-only hosts ---------------------------------------------------------------------


def _warning_once(self: logging.Logger, msg: object, *args: Any, **kwargs: Any) -> None:
    seen: set[tuple[str, str]] = _warning_once.seen  # type: ignore[attr-defined]
    key = (self.name, str(msg))
    if key not in seen:
        seen.add(key)
        self.warning(msg, *args, **kwargs)


_warning_once.seen = set()  # type: ignore[attr-defined]


@contextlib.contextmanager
def cpu_shims() -> Iterator[list[str]]:
    """Let diffusers 0.42's context parallelism run on a host without an accelerator.

    Inside the block (process-wide; restored on exit), only where needed:

    * ``torch.accelerator.device_count()`` returns 1 instead of 0: diffusers' set-up
      (``ModelMixin._resolve_parallel_config``) takes ``rank % device_count()``, which
      divides by zero on a CPU-only host;
    * ``logging.Logger.warning_once`` exists: diffusers' context-parallel split hook calls
      it (Wan's plan logs that a 1-D timestep is not split) on a logger that has it only
      once ``transformers`` has added it.

    Yields the names of the shims it installed. Wrap set-up and forwards::

        with ditops.integrations.shared.parallel.cpu_shims():
            model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=2))
            out = model(...)

    Nothing of this is installed by ``import ditops``.
    """
    installed: list[str] = []
    accel = getattr(torch, "accelerator", None)
    count = getattr(accel, "device_count", None)
    if count is not None and count() == 0:
        accel.device_count = lambda: 1  # type: ignore[union-attr]
        installed.append("torch.accelerator.device_count")
    if not hasattr(logging.Logger, "warning_once"):
        logging.Logger.warning_once = _warning_once  # type: ignore[attr-defined]
        installed.append("logging.Logger.warning_once")
    try:
        yield list(installed)
    finally:
        if "torch.accelerator.device_count" in installed:
            accel.device_count = count  # type: ignore[union-attr]
        if "logging.Logger.warning_once" in installed:
            del logging.Logger.warning_once  # type: ignore[attr-defined]


__all__ = [
    "Shards",
    "attend_across_ranks",
    "context_parallel_of",
    "cpu_shims",
    "heads_from_sequence",
    "plan_shards",
    "sequence_from_heads",
    "split_sizes",
]
