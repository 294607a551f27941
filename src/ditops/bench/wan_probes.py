"""Timing probes of the ``wan`` suite: where a forward's time goes (:class:`SectionTimer`),
what its self-attentions did (:class:`AttentionProbe`), and one timed denoiser call
(:func:`timed_step`). The ``parallel`` suite times its calls with :func:`timed_step` too.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ditops.bench.harness import sync

#: Where a forward's time goes: sub-modules of every block, timed by forward hooks; the
#: rest (patch embedding, norms, modulation, residuals, output) is the remainder.
SECTIONS = {"attn1": "self-attention", "attn2": "cross-attention", "ffn": "feed-forward"}


class SectionTimer:
    """Wall time spent inside each block's attn1 / attn2 / ffn during a ``with`` block."""

    def __init__(self, model: Any, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.seconds = {label: 0.0 for label in SECTIONS.values()}
        self._handles: list[Any] = []

    def __enter__(self) -> SectionTimer:
        for block in self.model.blocks:
            for attr, label in SECTIONS.items():
                module = getattr(block, attr)
                start: list[float] = []

                def pre(_m: Any, _a: Any, start: list[float] = start) -> None:
                    sync(self.device)
                    start.append(time.perf_counter())

                def post(
                    _m: Any, _a: Any, _o: Any, start: list[float] = start, label: str = label
                ) -> None:
                    sync(self.device)
                    self.seconds[label] += time.perf_counter() - start.pop()

                self._handles.append(module.register_forward_pre_hook(pre))
                self._handles.append(module.register_forward_hook(post))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()


class AttentionProbe:
    """What the self-attentions of a forward did, timed inside it (``with`` block).

    ``estimate_s`` / ``sparse_s``: time inside the ops ``estimate_block_mask`` and
    ``block_sparse_attention``; ``dense_s``: time inside dense SDPA called from a
    block's ``attn1`` (diffusers' processor or ditops' dense steps); ``estimates``:
    estimate calls; ``densities``: the block density of each mask attention ran with.
    The device is synchronised around each, so on GPUs the parts add up to wall time.
    """

    def __init__(self, model: Any, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.estimate_s = self.sparse_s = self.dense_s = 0.0
        self.estimates = 0
        self.densities: list[float] = []
        self._inside_self_attention = 0
        self._handles: list[Any] = []
        self._sdpa: Any = None

    def _timed(self, fn: Any, add: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            sync(self.device)
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            sync(self.device)
            add(time.perf_counter() - t0, args, out)
            return out

        return call

    def __enter__(self) -> AttentionProbe:
        from ditops.ops import block_sparse_attention as bsa
        from ditops.ops import estimate_block_mask as ebm

        def enter(*_: Any) -> None:
            self._inside_self_attention += 1

        def leave(*_: Any) -> None:
            self._inside_self_attention -= 1

        for block in self.model.blocks:
            self._handles.append(block.attn1.register_forward_pre_hook(enter))
            self._handles.append(block.attn1.register_forward_hook(leave))

        def add_dense(seconds: float, _args: Any, _out: Any) -> None:
            if self._inside_self_attention:
                self.dense_s += seconds

        def add_estimate(seconds: float, _args: Any, _out: Any) -> None:
            self.estimate_s += seconds
            self.estimates += 1

        def add_sparse(seconds: float, args: Any, _out: Any) -> None:
            self.sparse_s += seconds
            self.densities.append(float(args[3].float().mean()))

        # The ops are module instances: wrap their forward for this block only.
        for op, add in (
            (ebm.estimate_block_mask.op, add_estimate),
            (bsa.block_sparse_attention.op, add_sparse),
        ):
            op.forward = self._timed(type(op).forward.__get__(op), add)
        self._sdpa = torch.nn.functional.scaled_dot_product_attention
        torch.nn.functional.scaled_dot_product_attention = self._timed(self._sdpa, add_dense)
        return self

    def __exit__(self, *exc: object) -> None:
        from ditops.ops import block_sparse_attention as bsa
        from ditops.ops import estimate_block_mask as ebm

        torch.nn.functional.scaled_dot_product_attention = self._sdpa
        for op in (ebm.estimate_block_mask.op, bsa.block_sparse_attention.op):
            del op.forward
        for h in self._handles:
            h.remove()

    def as_dict(self) -> dict[str, Any]:
        return {
            "estimate_s": self.estimate_s,
            "sparse_s": self.sparse_s,
            "dense_s": self.dense_s,
            "attention_s": self.sparse_s + self.dense_s,
            "estimates": self.estimates,
            "density": (sum(self.densities) / len(self.densities) if self.densities else None),
            "densities": self.densities,
        }


def timed_step(
    model: Any,
    latents: torch.Tensor,
    timesteps: torch.Tensor,
    text: torch.Tensor,
    step: int,
    n_steps: int,
    device: torch.device,
) -> tuple[torch.Tensor, float]:
    """One denoiser call at ``step``, inside the cache context a diffusers pipeline sets."""
    with (
        torch.inference_mode(),
        model.cache_context("cond", step_index=step, num_inference_steps=n_steps),
    ):
        sync(device)
        t0 = time.perf_counter()
        out = model(
            hidden_states=latents,
            timestep=timesteps[step : step + 1],
            encoder_hidden_states=text,
            return_dict=False,
        )[0]
        sync(device)
        return out, time.perf_counter() - t0
