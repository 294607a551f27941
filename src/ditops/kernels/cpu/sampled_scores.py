"""The sampled estimate's fp32 block scores, one head per worker thread.

The same arithmetic as :func:`ditops.attention.methods.sampled_block_scores_fp32` (an
fp32 matmul of the scaled sampled query rows against the head's keys, a softmax per row,
the probabilities summed per key block and over each block's sampled rows), with the
heads handed out by :func:`ditops.kernels.cpu.workers.run_items`: each worker runs one
head at a time on one intra-op thread, so a head's key conversion, scores and
probabilities stay in that core's cache and no call waits at an OpenMP barrier for a
descheduled thread (on a 2-core EPYC with a busy neighbour, the per-call parallel
regions of the 2-thread form cost more than the arithmetic:
``benchmarks/cpu/probes/estimate_workers.txt``). Each head writes its own rows of the
output, so which thread runs it changes no bit.
"""

from __future__ import annotations

import torch

from ditops.kernels.cpu import blocks, workers

#: Sampled rows scored at once per head (the scores and probabilities of 64 rows at
#: 8k keys are 2 MiB each: they stay in cache between the matmul, the softmax and the
#: sums).
ROW_CHUNK = 64


def sampled_block_scores_fp32(
    qs: torch.Tensor,
    k: torch.Tensor,
    allowed: torch.Tensor | None,
    *,
    block_size: int,
    samples: int,
    kv_blocks: int,
) -> torch.Tensor:
    """fp32 ``[B, Nq, R / samples, kv_blocks]`` softmax mass per (query block, key block).

    ``qs``: fp32 ``[B, Nq, R, D]`` sampled query rows, already times the scale;
    ``k``: ``[B, Nkv, Skv, D]`` keys (any float dtype and strides; GQA by
    ``Nq // Nkv``); ``allowed``: bool ``[R, Skv]`` (causal) or None.
    """
    batch, heads, n_rows, dim = (int(s) for s in qs.shape)
    kv_heads, kv_len = int(k.shape[1]), int(k.shape[2])
    group = heads // kv_heads
    full = kv_len // block_size
    out = torch.empty(batch, heads, n_rows // samples, kv_blocks, dtype=torch.float32)
    chunk = max(samples, ROW_CHUNK // samples * samples)

    def body(scratch: blocks.Scratch):
        converted: list[tuple[int, int] | None] = [None]

        def run(item: tuple[int, int]) -> None:
            b, h = item
            kf = scratch.take(0, kv_len, dim, torch.float32)
            if converted[0] != (b, h // group):  # a key head converted once per worker run
                kf.copy_(k[b, h // group])
                converted[0] = (b, h // group)
            scores = scratch.take(1, chunk, kv_len, torch.float32)
            probs = scratch.take(2, chunk, kv_len, torch.float32)
            for r0 in range(0, n_rows, chunk):
                r1 = min(n_rows, r0 + chunk)
                s, p = scores[: r1 - r0], probs[: r1 - r0]
                torch.mm(qs[b, h, r0:r1], kf.T, out=s)
                if allowed is not None:
                    s.masked_fill_(~allowed[r0:r1], float("-inf"))
                torch.softmax(s, -1, out=p)
                mass = p[:, : full * block_size].unflatten(-1, (full, block_size)).sum(-1)
                if full < kv_blocks:  # a partial last key block
                    mass = torch.cat([mass, p[:, full * block_size :].sum(-1, keepdim=True)], -1)
                out[b, h, r0 // samples : r1 // samples] = mass.unflatten(
                    0, ((r1 - r0) // samples, samples)
                ).sum(1)

        return run

    workers.run_items([(b, h) for b in range(batch) for h in range(heads)], body)
    return out
