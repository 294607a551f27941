"""The permuted mode: tokens clustered per head, sorted by cluster, attended block-sparse
in that order and put back."""

from __future__ import annotations

import pytest
import torch

import ditops.attention.permute as permute_mod
from ditops.attention.permute import (
    TokenPermutation,
    assign,
    cluster_permutation,
    initial_centroids,
    kmeans,
)
from ditops.attention.reference import block_sparse_attention_reference
from ditops.attention.schedule import BlockSparseConfig
from ditops.layers.sparse_attention import BlockSparseAttention, dense_attention
from ditops.ops.block_sparse_attention import block_sparse_attention


def _scattered(heads: int = 2, seq: int = 640, dim: int = 32, groups: int = 8, seed: int = 0):
    """q/k whose tokens belong to ``groups`` objects scattered at random over the
    sequence; a token attends to its own object's tokens."""
    gen = torch.Generator().manual_seed(seed)
    label = torch.randint(0, groups, (heads, seq), generator=gen)
    centres = torch.randn(heads, groups, dim, generator=gen) * 2.0
    base = torch.gather(centres, 1, label[..., None].expand(-1, -1, dim))
    q = base + 0.2 * torch.randn(heads, seq, dim, generator=gen)
    k = base + 0.2 * torch.randn(heads, seq, dim, generator=gen)
    v = torch.randn(heads, seq, dim, generator=gen)
    return q[None], k[None], v[None], label


def test_orders_are_permutations_with_the_prefix_in_place_and_unpermute_inverts() -> None:
    q, k, v, _ = _scattered()
    k = k[:, :1]  # GQA: one key head for two query heads
    perm = cluster_permutation(q, k, fixed=100, block_size=64)
    for order, n in ((perm.q_order, 2), (perm.k_order, 1)):
        assert tuple(order.shape) == (1, n, 640)
        assert torch.equal(order.sort(-1).values, torch.arange(640).expand(1, n, 640))
        assert torch.equal(order[..., :100], torch.arange(100).expand(1, n, 100))
    x = torch.randn(1, 2, 640, 7, dtype=torch.bfloat16)
    assert torch.equal(perm.unpermute(perm.permute_q(x)), x)
    assert torch.equal(perm.permute_q(x)[0, 1, 5], x[0, 1, perm.q_order[0, 1, 5]])
    assert torch.equal(perm.permute_kv(k)[0, 0, 7], k[0, 0, perm.k_order[0, 0, 7]])


def test_kmeans_finds_separated_clusters_and_the_order_makes_them_contiguous() -> None:
    q, k, _, label = _scattered(groups=4)
    # Twice as many clusters as objects (as with one per block): each cluster is pure.
    perm = cluster_permutation(q, k, clusters=8, block_size=80)
    for h in range(2):
        sorted_labels = label[h, perm.q_order[0, h]]
        # contiguous clusters of one object each: at most 7 changes along the order
        assert int((sorted_labels[1:] != sorted_labels[:-1]).sum()) <= 7


def test_warm_start_keeps_converged_centroids() -> None:
    x = torch.randn(3, 500, 16, generator=torch.Generator().manual_seed(0))
    labels, cent = kmeans(x, initial_centroids(x, 6), iters=100, every=1)
    again, cent2 = kmeans(x, cent, iters=1, every=1)
    assert torch.equal(again, labels)
    assert torch.allclose(cent2, cent)
    assert torch.equal(assign(x, cent), labels)


def _layer(**fields) -> BlockSparseAttention:
    return BlockSparseAttention(block_size=64, stride=8, permute=True, **fields)


def test_output_is_dense_attention_when_every_block_runs() -> None:
    q, k, v, _ = _scattered()
    # A budget of every block (rounding keeps all 100): the permutation then changes only
    # the order keys are summed in.
    layer = _layer(sparsity=0.001)
    out = layer(q, k, v)
    assert layer.last_density().block_density == 1.0
    torch.testing.assert_close(out, dense_attention(q, k, v), rtol=1e-5, atol=1e-5)
    # mass=1 asks for every block: dense attention runs, bit for bit.
    assert torch.equal(_layer(mass=1.0)(q, k, v), dense_attention(q, k, v))


@pytest.mark.parametrize("layout", ["BNSD", "BSND"])
def test_output_is_block_sparse_attention_in_the_permuted_order(layout) -> None:
    q, k, v, _ = _scattered()
    layer = _layer(sparsity=0.6, method="sampled", dense_blocks=1)
    args = (q, k, v) if layout == "BNSD" else tuple(t.transpose(1, 2) for t in (q, k, v))
    out = layer(*args, layout=layout, step=4)
    perm = layer._last_permutation
    mask = layer._last_run[0]
    qp, kp, vp = perm.permute_q(q), perm.permute_kv(k), perm.permute_kv(v)
    counts = mask.sum(-1, dtype=torch.int32)
    want = perm.unpermute(block_sparse_attention(qp, kp, vp, mask, counts, block_size=64))
    if layout == "BSND":
        want = want.transpose(1, 2)
    assert torch.equal(out, want)
    ref = perm.unpermute(block_sparse_attention_reference(qp, kp, vp, mask, block_size=64))
    if layout == "BSND":
        ref = ref.transpose(1, 2)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # The first frame (block 0) is in place and its rows and columns are kept.
    assert bool(mask[..., 0, :].all()) and bool(mask[..., :, 0].all())
    assert 0.35 < layer.last_density().block_density < 0.45


def test_scattered_objects_are_attended_better_in_the_permuted_order() -> None:
    q, k, v, _ = _scattered(seq=1280, groups=10)
    dense = dense_attention(q, k, v)

    def err(layer):
        return float((layer(q, k, v) - dense).norm() / dense.norm())

    plain = err(BlockSparseAttention(block_size=64, stride=8, sparsity=0.75, method="sampled"))
    permuted = err(_layer(sparsity=0.75, method="sampled"))
    assert permuted < 0.5 * plain, (permuted, plain)


def test_clusters_are_warm_started_and_reused_across_steps(monkeypatch) -> None:
    q, k, v, _ = _scattered()
    seen: list[TokenPermutation | None] = []
    real = permute_mod.cluster_permutation

    def spy(*args, previous=None, **kw):
        seen.append(previous)
        return real(*args, previous=previous, **kw)

    import ditops.layers.sparse_attention as layer_mod

    monkeypatch.setattr(layer_mod, "cluster_permutation", spy)
    # estimate_every=1: clustered at every step, each from the step before's centroids.
    layer = _layer(sparsity=0.5)
    layer(q, k, v, step=0, branch="cond")
    first = layer._last_permutation
    layer(q, k, v, step=1, branch="cond")
    assert seen == [None, first]
    layer(q, k, v, step=1, branch="uncond")  # another branch: its own clusters
    assert seen[-1] is None
    layer(q, k, v, step=0, branch="cond")  # a new pipeline call: a cold start
    assert seen[-1] is None
    # estimate_every=2: the permutation and its mask are reused at the next step.
    seen.clear()
    layer = _layer(sparsity=0.5, estimate_every=2)
    layer(q, k, v, step=0)
    p0 = layer._last_permutation
    layer(q, k, v, step=1)
    assert layer._last_permutation is p0 and len(seen) == 1
    layer(q, k, v, step=2)
    assert seen[-1] is p0 and layer._last_permutation is not p0


def test_warm_started_clusters_cost_one_round(monkeypatch) -> None:
    q, k, _, _ = _scattered()
    rounds = []
    real = permute_mod.kmeans
    monkeypatch.setattr(
        permute_mod, "kmeans", lambda x, c, iters, **kw: rounds.append(iters) or real(x, c, iters)
    )
    first = cluster_permutation(q, k, block_size=64)
    cold = list(rounds)
    rounds.clear()
    cluster_permutation(q, k, block_size=64, previous=first)
    # q and k (per head on CPU's worker threads): cold rounds first, then one round.
    assert cold and set(cold) == {permute_mod.COLD_ITERS}
    assert len(rounds) == len(cold) and set(rounds) == {permute_mod.WARM_ITERS}


@pytest.mark.parametrize("warm", [False, True])
def test_heads_on_worker_threads_give_the_batched_bits(monkeypatch, warm: bool) -> None:
    from ditops.kernels.cpu import workers

    monkeypatch.setattr(workers, "WORKERS", 2)
    q, k, _, _ = _scattered(heads=4)
    q, k = q.to(torch.bfloat16), k.to(torch.bfloat16)
    perms = []
    for on_workers in (False, True):
        monkeypatch.setattr(permute_mod, "CPU_HEADS_ON_WORKERS", on_workers)
        perm = cluster_permutation(q, k, fixed=64, block_size=64)
        if warm:
            perm = cluster_permutation(q, k, fixed=64, block_size=64, previous=perm)
        perms.append(perm)
    for name in ("q_order", "k_order", "q_centroids", "k_centroids"):
        assert torch.equal(getattr(perms[0], name), getattr(perms[1], name)), name


def test_permute_with_causal_is_refused() -> None:
    with pytest.raises(ValueError, match="causal"):
        BlockSparseConfig(sparsity=0.5, permute=True, causal=True)
    with pytest.raises(TypeError, match="permute"):
        BlockSparseConfig(sparsity=0.5, permute=1)
    with pytest.raises(ValueError, match="clusters"):
        BlockSparseConfig(sparsity=0.5, permute=True, clusters=-1)


def test_each_head_keeps_the_order_that_serves_it() -> None:
    from ditops.attention.permute import choose_heads
    from ditops.bench.video_attention import scattered_attention

    q, k, _, _ = _scattered(seq=1280, groups=10)  # semantic heads: clustered
    perm = cluster_permutation(q, k, block_size=64)
    chosen = choose_heads(q, k, perm, block_size=64, keep=0.25)
    assert chosen.clustered is not None and bool(chosen.clustered.all())
    # Video-like heads: the local one (3) stays in video order, semantic ones (0-2) mostly
    # go clustered (at this small size one may not gain).
    lq, lk, _ = scattered_attention(9, 16, 24, heads=4, dim=64)
    lperm = cluster_permutation(lq, lk, block_size=64)
    lchosen = choose_heads(lq, lk, lperm, block_size=64, keep=0.25)
    assert not bool(lchosen.clustered[0, 3]) and int(lchosen.clustered[0, :3].sum()) >= 2
    assert torch.equal(lchosen.q_order[0, 3], torch.arange(lq.shape[2]))
    # A warm start keeps the choice.
    warm = cluster_permutation(lq, lk, block_size=64, previous=lchosen)
    assert warm.clustered is lchosen.clustered
    assert torch.equal(warm.q_order[0, 3], torch.arange(lq.shape[2]))


def test_a_warm_step_gathers_q_k_and_v_once_each(monkeypatch) -> None:
    """The estimate and the attention share the permuted q and k (each is a copy of the
    whole tensor: a second gather would cost as much as the first)."""
    q, k, v, _ = _scattered()
    layer = _layer(sparsity=0.5)
    layer(q, k, v, step=0)
    gathered = []
    real = TokenPermutation._gather
    monkeypatch.setattr(
        TokenPermutation, "_gather", staticmethod(lambda x, o: gathered.append(x) or real(x, o))
    )
    out = layer(q, k, v, step=1)  # warm: no order choice, which gathers for its own test
    assert [id(x) for x in gathered] == [id(q), id(k), id(v)]
    perm, (mask, _, _) = layer._last_permutation, layer._last_run
    qp, kp, vp = perm.permute_q(q), perm.permute_kv(k), perm.permute_kv(v)
    counts = mask.sum(-1, dtype=torch.int32)
    assert torch.equal(
        out, perm.unpermute(block_sparse_attention(qp, kp, vp, mask, counts, block_size=64))
    )
