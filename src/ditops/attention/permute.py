"""Tokens permuted per head so that related ones share blocks (the permuted mode).

In a video DiT a query often needs keys scattered over the whole video (the same object
in other frames and places). In the token order of the video a 128 x 128 tile then
holds a few keys a query block needs among many it does not, and even the best block
mask in that order (the block oracle) keeps much it does not need. Sparse VideoGen 2
(arXiv 2505.18875) changes which tokens share a tile: per head it clusters the queries
and the keys by k-means on their vectors, orders the tokens so that every cluster is
contiguous, attends block-sparse in that order and puts the outputs back.

Here, per batch entry and head (and per KV head for keys under GQA):

1. **Spherical k-means** of the query vectors and of the key vectors (:func:`kmeans`):
   ``clusters`` unit centroids (default: one per block of the permuted tokens),
   assignment by the largest ``x . c`` (the nearest direction: what a dot-product
   attention sees, and no bias term: one batched matmul in the inputs' dtype and a max,
   measured the cheapest on CPU), centroids moved to the mean direction of their tokens
   among every
   :data:`UPDATE_EVERY`-th one (a one-hot matmul). A cold start takes its centroids
   from tokens evenly spaced in the original order (deterministic; neighbours in the
   video get neighbouring cluster ids, so clusters that end up in one block tend to be
   alike) and runs ``iters`` rounds, all but the last on the subsample; a warm start
   (the previous step's centroids, see :class:`TokenPermutation`) runs one: every token
   is assigned to last step's centroids, which then move once, for the next step.
2. **The order** (:func:`cluster_order`): the first ``fixed`` positions (the first
   frame's blocks, or text then first frame: what the schedule keeps dense) stay where
   they are; the rest are sorted by cluster id, stably (original order within a
   cluster). Queries and keys get their own orders; values follow the keys'.
3. The block mask is estimated on the permuted q and k and block-sparse attention runs
   on the permuted q, k, v with the same ops (any device's kernels: the tensors are
   plain contiguous BNSD tensors); the output rows go back to their positions
   (:meth:`TokenPermutation.unpermute`, the exact inverse of the permutation: a copy,
   no arithmetic).

Cost (measured in ``benchmarks/cpu/probes/permute_cost.txt``): one assignment matmul per
round for q and for k, ``S x clusters x D`` each, plus the gathers; with ``clusters``
one per block that is ``clusters / S`` of a dense attention's ``q k^T`` per round.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ditops.tracing import traced

#: Rounds of k-means from a cold start (no previous centroids), and from a warm one.
COLD_ITERS = 3
WARM_ITERS = 1
#: Centroid updates read every this many tokens (the assignment reads all of them).
UPDATE_EVERY = 4


def initial_centroids(x: torch.Tensor, clusters: int) -> torch.Tensor:
    """``[G, C, D]`` in ``x``'s dtype: ``clusters`` tokens of ``x`` ``[G, S, D]``, evenly
    spaced, as unit vectors."""
    seq = int(x.shape[1])
    idx = (torch.arange(clusters, device=x.device, dtype=torch.float64) + 0.5) * seq / clusters
    return _unit(x.index_select(1, idx.long().clamp(max=seq - 1)))


def _unit(c: torch.Tensor) -> torch.Tensor:
    c32 = c.float()
    return (c32 / c32.norm(dim=-1, keepdim=True).clamp(min=1e-12)).to(c.dtype)


def assign(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """int64 ``[G, S]``: each token's centroid of the largest ``x . c`` (unit centroids:
    the nearest in direction; one batched matmul in ``x``'s dtype and a max)."""
    return torch.bmm(x, centroids.to(x.dtype).transpose(1, 2)).max(-1).indices


def update(
    x: torch.Tensor, labels: torch.Tensor, centroids: torch.Tensor, every: int = 1
) -> torch.Tensor:
    """``[G, C, D]``: the mean direction of each cluster's tokens among every ``every``-th
    one (an empty cluster keeps its centroid): a one-hot matmul in ``x``'s dtype (fp32
    accumulation), normalised."""
    if every > 1:
        x, labels = x[:, ::every], labels[:, ::every]
    ids = torch.arange(int(centroids.shape[1]), device=x.device)[:, None]
    sums = torch.bmm((labels[:, None, :] == ids).to(x.dtype), x)  # [G, C, D]
    return torch.where(sums.abs().amax(-1, keepdim=True) > 0, _unit(sums), centroids)


def kmeans(
    x: torch.Tensor, centroids: torch.Tensor, iters: int, every: int = UPDATE_EVERY
) -> tuple[torch.Tensor, torch.Tensor]:
    """``iters`` (>= 1) rounds of spherical k-means on ``x`` ``[G, S, D]`` from unit
    ``centroids`` ``[G, C, D]``: ``(labels [G, S], centroids)``. Rounds before the last
    run on every ``every``-th token only (cheap); the last assigns every token (the
    labels returned) and moves the centroids once more, from the same subsample, for a
    warm start next time."""
    sub = x[:, ::every] if every > 1 else x
    for _ in range(iters - 1):
        centroids = update(sub, assign(sub, centroids), centroids)
    labels = assign(x, centroids)
    return labels, update(x, labels, centroids, every)


def cluster_order(labels: torch.Tensor, fixed: int) -> torch.Tensor:
    """int64 ``[G, fixed + S']``: the permuted order (position ``p`` holds original token
    ``order[p]``): ``0 .. fixed - 1`` in place, then tokens ``fixed ..`` sorted by their
    ``labels`` ``[G, S']``, stably."""
    g = int(labels.shape[0])
    rest = labels.argsort(dim=-1, stable=True) + fixed
    head = torch.arange(fixed, device=labels.device).expand(g, fixed)
    return torch.cat([head, rest], dim=-1)


@dataclass(frozen=True)
class TokenPermutation:
    """One call's permutation of query and key tokens, per batch entry and head.

    ``q_order`` ``[B, Nq, Sq]`` and ``k_order`` ``[B, Nkv, Skv]`` (int64): permuted
    position ``p`` holds original token ``order[..., p]``; ``q_centroids`` /
    ``k_centroids`` (unit vectors ``[B, N, C, D]``, the inputs' dtype): the k-means
    state a later step starts from.
    """

    q_order: torch.Tensor
    k_order: torch.Tensor
    q_centroids: torch.Tensor
    k_centroids: torch.Tensor
    fixed: int
    #: Per KV head ``[B, Nkv]``: whether it runs in the clustered order (else the
    #: original, its orders the identity); ``None``: every head clustered.
    clustered: torch.Tensor | None = None

    def restricted(self, clustered: torch.Tensor) -> TokenPermutation:
        """The same with the heads where ``clustered`` (bool ``[B, Nkv]``) is false put
        back in the original order (their centroids kept for warm starts)."""
        group = int(self.q_order.shape[1]) // int(self.k_order.shape[1])
        q_keep = clustered.repeat_interleave(group, dim=1)[..., None]
        q_id = torch.arange(int(self.q_order.shape[2]), device=self.q_order.device)
        k_id = torch.arange(int(self.k_order.shape[2]), device=self.k_order.device)
        return TokenPermutation(
            torch.where(q_keep, self.q_order, q_id),
            torch.where(clustered[..., None], self.k_order, k_id),
            self.q_centroids,
            self.k_centroids,
            self.fixed,
            clustered,
        )

    @staticmethod
    def _flat(order: torch.Tensor) -> torch.Tensor:
        b, n, s = (int(x) for x in order.shape)
        base = torch.arange(b * n, device=order.device).reshape(b, n, 1) * s
        return (order + base).reshape(-1)

    @staticmethod
    def _gather(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        b, n, s, d = (int(t) for t in x.shape)
        flat = TokenPermutation._flat(order)
        return x.reshape(b * n * s, d).index_select(0, flat).view(b, n, s, d)

    def permute_q(self, q: torch.Tensor) -> torch.Tensor:
        """BNSD queries (or anything laid out like them) in the permuted order, contiguous."""
        return self._gather(q, self.q_order)

    def permute_kv(self, x: torch.Tensor) -> torch.Tensor:
        """BNSD keys or values (``Nkv`` heads) in the keys' permuted order, contiguous."""
        return self._gather(x, self.k_order)

    def unpermute(self, out: torch.Tensor) -> torch.Tensor:
        """BNSD output rows of permuted queries back in the original order (the exact
        inverse of :meth:`permute_q`)."""
        b, n, s, d = (int(t) for t in out.shape)
        back = torch.empty(b * n * s, d, dtype=out.dtype, device=out.device)
        back.index_copy_(0, self._flat(self.q_order), out.reshape(b * n * s, d))
        return back.view(b, n, s, d)


def default_clusters(seq: int, fixed: int, block_size: int) -> int:
    """One cluster per block of the permuted tokens (at least 1)."""
    return max(1, -(-(seq - fixed) // block_size))


def _cluster(
    x: torch.Tensor, fixed: int, clusters: int, previous: torch.Tensor | None, iters: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order [B, N, S], centroids [B, N, C, D])`` of BNSD ``x``'s tokens past ``fixed``."""
    b, n, s, d = (int(t) for t in x.shape)
    flat = x.reshape(b * n, s, d)  # a view for contiguous x: no copy before the matmuls
    rest = flat[:, fixed:]
    c = min(clusters, s - fixed)
    if previous is not None and tuple(previous.shape) == (b, n, c, d):
        start, rounds = previous.reshape(b * n, c, d), WARM_ITERS
    else:
        start, rounds = initial_centroids(rest, c), iters
    # The prefix's tokens join the assignment (a matmul over the whole of x, which a
    # strided slice would copy first) and the updates, their labels unused: a prefix of
    # a few blocks moves some centroids a little.
    labels, centroids = _kmeans_per_head(flat, start, rounds)
    return cluster_order(labels[:, fixed:], fixed).view(b, n, s), centroids.view(b, n, c, d)


#: On CPU, run each head's k-means on one worker thread (one intra-op thread each):
#: the rounds' many small calls then wait at no 2-thread barrier for a descheduled
#: thread (warm clustering 6.4% of dense SDPA on 2 threads at load 11-12,
#: ``benchmarks/cpu/probes/permute_cost-issue39.txt``). Same bits as the batched form.
CPU_HEADS_ON_WORKERS = True


def _kmeans_per_head(
    flat: torch.Tensor, start: torch.Tensor, rounds: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kmeans` of ``flat`` ``[G, S, D]``, on CPU one head per worker thread."""
    groups = int(flat.shape[0])
    # Under torch.compile the batched form is traced (worker threads are not traceable).
    compiling = traced()
    if flat.device.type != "cpu" or groups < 2 or not CPU_HEADS_ON_WORKERS or compiling:
        return kmeans(flat, start, rounds)
    from ditops.kernels.cpu import workers

    labels = torch.empty(groups, int(flat.shape[1]), dtype=torch.int64)
    centroids = torch.empty(start.shape, dtype=start.dtype)

    def body(_scratch: object):
        def run(i: int) -> None:
            one_labels, one_centroids = kmeans(flat[i : i + 1], start[i : i + 1], rounds)
            labels[i], centroids[i] = one_labels[0], one_centroids[0]

        return run

    workers.run_items(range(groups), body)
    return labels, centroids


def cluster_permutation(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    fixed: int = 0,
    clusters: int | None = None,
    block_size: int = 128,
    iters: int = COLD_ITERS,
    previous: TokenPermutation | None = None,
) -> TokenPermutation:
    """The permutation of BNSD ``q`` and ``k`` (see the module docstring).

    ``fixed``: leading positions kept in place (clamped to each length); ``clusters``:
    k-means clusters for q and for k (default: one per ``block_size`` tokens past
    ``fixed``); ``iters``: rounds from a cold start; ``previous``: the permutation of an
    earlier step with the same shapes, whose centroids warm-start this one (one round).
    """
    q_fixed, k_fixed = min(fixed, int(q.shape[2])), min(fixed, int(k.shape[2]))
    with torch.no_grad():
        cq = clusters or default_clusters(int(q.shape[2]), q_fixed, block_size)
        ck = clusters or default_clusters(int(k.shape[2]), k_fixed, block_size)
        if int(q.shape[2]) == q_fixed or int(k.shape[2]) == k_fixed:
            q_order = torch.arange(int(q.shape[2]), device=q.device).expand(*q.shape[:3])
            k_order = torch.arange(int(k.shape[2]), device=k.device).expand(*k.shape[:3])
            empty = q.new_zeros(0, dtype=torch.float32)
            return TokenPermutation(q_order, k_order, empty, empty, fixed)
        prev_q = None if previous is None else previous.q_centroids
        prev_k = None if previous is None else previous.k_centroids
        q_order, q_cent = _cluster(q, q_fixed, cq, prev_q, iters)
        k_order, k_cent = _cluster(k, k_fixed, ck, prev_k, iters)
    perm = TokenPermutation(q_order, k_order, q_cent, k_cent, fixed)
    if previous is not None and previous.clustered is not None:
        perm = perm.restricted(previous.clustered)
    return perm


def _cross_coverage(
    q: torch.Tensor, k: torch.Tensor, *, block_size: int, keep: float, scale: float
) -> torch.Tensor:
    """fp32 ``[B, Nq]``: per head, the mean over query blocks of the mass that one
    sampled row of the block gives the ``round(keep * KVb)`` key blocks the block's other
    sampled row ranks best (and the other way round). Two rows per block, at a quarter
    and three quarters of it: a block of alike queries scores high, a block mixing
    queries that need different keys scores low even when each row alone is sharp."""
    b, n, s, d = (int(t) for t in q.shape)
    q_blocks = -(-s // block_size)
    kv_len = int(k.shape[2])
    kv_blocks = -(-kv_len // block_size)
    group = n // int(k.shape[1])
    starts = torch.arange(q_blocks, device=q.device) * block_size
    real = (s - starts).clamp(max=block_size)
    rows = torch.stack([starts + real // 4, starts + (3 * real) // 4], -1).reshape(-1)
    top = max(1, min(kv_blocks, round(keep * kv_blocks)))
    pad = kv_blocks * block_size - kv_len
    out = torch.empty(b, n, dtype=torch.float32, device=q.device)
    for bi in range(b):
        for h in range(n):
            logits = q[bi, h].index_select(0, rows) @ k[bi, h // group].T  # q's dtype
            probs = torch.softmax(logits.float() * scale, dim=-1)
            if pad:
                probs = torch.nn.functional.pad(probs, (0, pad))
            mass = probs.view(q_blocks, 2, kv_blocks, block_size).sum(-1)  # [Qb, 2, KVb]
            best = mass.topk(top, dim=-1).indices  # each row's own choice
            other = mass.flip(1).gather(-1, best)  # judged by the other row
            out[bi, h] = other.sum(-1).mean()
    return out


def choose_heads(
    q: torch.Tensor,
    k: torch.Tensor,
    perm: TokenPermutation,
    *,
    block_size: int,
    keep: float | None,
    scale: float | None = None,
) -> TokenPermutation:
    """``perm`` with each KV head in the order (clustered or original) whose blocks
    serve its queries better: heads whose attention is local in the video (a query needs
    its neighbours) can lose by sorting, heads whose attention is semantic gain.

    Judged in both orders by :func:`_cross_coverage` at density ``keep`` (``None``, a
    mass target: 0.25), summed over a KV head's query heads: two sampled rows per block
    attend to every key (``2 / block_size`` of a dense attention per order). Run when
    clusters start cold; warm starts keep the choice (:attr:`TokenPermutation.clustered`).
    A block's single sampled row would not do: it rates its own best blocks, and a
    clustered block mixing far-apart tokens (k-means on rotary features can alias) looks
    as good as a coherent one.
    """
    scale = int(q.shape[-1]) ** -0.5 if scale is None else scale
    keep = 0.25 if keep is None else keep
    with torch.no_grad():
        plain = _cross_coverage(q, k, block_size=block_size, keep=keep, scale=scale)
        mine = _cross_coverage(
            perm.permute_q(q), perm.permute_kv(k), block_size=block_size, keep=keep, scale=scale
        )
        gain = mine - plain  # [B, Nq]
        group = int(q.shape[1]) // int(k.shape[1])
        gain = gain.reshape(int(gain.shape[0]), -1, group).sum(-1)
    return perm.restricted(gain > 0)
