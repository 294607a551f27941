"""Joint text + video attention with the video queries block-sparse.

Video DiTs with one joint attention over text and video tokens (CogVideoX: text first;
HunyuanVideo: text last) make the same split by queries on a sparse step:

* text queries over every key: dense (``dense``, the family's own attention call, given
  the rows of the model's mask that belong to them, if any);
* video queries over ``[kept text keys, video keys]`` block-sparse: per sample, the text
  keys a key mask keeps (all of them without one; padded ones are left out, so they are
  masked exactly) are put *first*, so that the estimator's leading ``dense_blocks``
  cover them as dense columns together with the first frame's keys
  (``ceil((text + frame) / block)`` blocks: the block that straddles the two, and as many
  leading query block rows, run dense too, counted in the density the estimator keeps to,
  so the density asked is the density run). Softmax does not depend on the order of the
  keys: this is the joint attention with its video part block-sparse.

Each sample of a batch keeps its mask under its own branch name (``cond#1``): the samples
of one call (CogVideoX's pipeline batches the guidance branches) see different inputs.
With a key mask, a sample whose left-out text keys or values are not finite runs dense
with the mask instead (the meaning takes NaN from them: a fully padded sample's text).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from ditops.integrations.shared.steps import StepState

#: ``dense(q, k, v, mask) -> out``, all ``[B, S, H, D]``: the family's own dense attention.
DenseFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def frame_tokens(steps: StepState) -> int:
    """Tokens of the first latent frame (0 when the latent shape is not known): the
    latent's last two dims over the patch's last two."""
    shape = steps.latent_shape
    if shape is None:
        return 0
    ph, pw = steps.patch_size[-2:]
    return (int(shape[-2]) // ph) * (int(shape[-1]) // pw)


def joint_sparse_attention(
    sparse: nn.Module,
    steps: StepState,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    text: int,
    dense: DenseFn,
    *,
    text_first: bool,
    keep: torch.Tensor | None = None,
    text_rows_mask: torch.Tensor | None = None,
    video_lead: int | None = None,
) -> torch.Tensor:
    """One sparse step of a joint attention (see the module docstring).

    Args:
        sparse: the :class:`~ditops.layers.sparse_attention.BlockSparseAttention` layer.
        steps: the model's step state (step, guidance branch, latent shape, patch size).
        query, key, value: ``[B, N, H, D]``, ``N = text + video``, text rows first
            (``text_first``) or last.
        text: the number of text tokens.
        dense: the family's dense attention, ``[B, S, H, D]`` in and out.
        keep: bool ``[B, text]``, the text keys a key mask keeps (None: all).
        text_rows_mask: the mask the text queries are given (None: none).
        video_lead: the leading video rows whose keys run dense (None: the first latent
            frame's, :func:`frame_tokens`; HunyuanVideo-Framepack adds its history).

    Returns ``[B, N, H, D]``, rows in the order given.
    """
    batch, n = query.shape[:2]
    video = n - text
    text_rows = slice(0, text) if text_first else slice(video, n)
    video_rows = slice(text, n) if text_first else slice(0, video)
    text_out = dense(query[:, text_rows], key, value, text_rows_mask)
    poisoned = [False] * batch if keep is None else _padding_not_finite(key, value, keep, text_rows)
    frame = frame_tokens(steps) if video_lead is None else video_lead
    block = sparse.config.block_size  # type: ignore[union-attr]
    outs = []
    for b in range(batch):
        one = slice(b, b + 1)
        q = query[one, video_rows]
        if poisoned[b]:  # the meaning takes 0 * NaN from them: dense, with the key mask
            assert keep is not None
            kept = torch.cat(
                [keep[b], keep.new_ones(video)] if text_first else [keep.new_ones(video), keep[b]]
            ).view(1, 1, 1, n)
            outs.append(dense(q, key[one], value[one], kept))
            continue
        keys, values = (
            torch.cat([_text_keys(t[one, text_rows], keep, b), t[one, video_rows]], dim=1)
            for t in (key, value)
        )
        lead = int(keys.shape[1]) - video  # the kept text keys, first
        dense_blocks = math.ceil((lead + min(frame, video)) / block)
        branch = steps.branch if batch == 1 else f"{steps.branch}#{b}"
        outs.append(
            sparse(
                q,
                keys,
                values,
                layout="BSND",
                step=steps.current(),
                branch=branch,
                dense_blocks=dense_blocks,
            )
        )
    video_out = torch.cat(outs, dim=0)
    text_out = text_out.to(video_out.dtype)
    parts = [text_out, video_out] if text_first else [video_out, text_out]
    return torch.cat(parts, dim=1)


def _text_keys(t: torch.Tensor, keep: torch.Tensor | None, b: int) -> torch.Tensor:
    return t if keep is None else t[:, keep[b]]


def _padding_not_finite(
    key: torch.Tensor, value: torch.Tensor, keep: torch.Tensor, text_rows: slice
) -> list[bool]:
    """Per sample: whether a text key the mask leaves out has a non-finite key or value.

    The sparse path leaves those keys out; the meaning (attention with the key mask)
    multiplies their values by 0 and adds -inf to their scores, which gives NaN from a
    NaN or an inf. One host read per call (the mask is read on the host anyway)."""
    finite = torch.isfinite(key[:, text_rows]).flatten(2).all(-1)
    finite &= torch.isfinite(value[:, text_rows]).flatten(2).all(-1)
    return [bool(b) for b in (~finite & ~keep).any(-1).tolist()]
