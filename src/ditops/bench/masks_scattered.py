"""The ``masks`` suite's scattered source (``--size scattered``): semantic attention whose
related tokens are spread over the video (:func:`ditops.bench.video_attention.scattered_attention`
style), where the permuted mode (``BlockSparseConfig(permute=True)``) and mass targets are
compared with the block oracles of both token orders; and its plot.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ditops.attention.methods import DEFAULT_SAMPLES
from ditops.bench.harness import Case
from ditops.bench.video_attention import BLOCK, DIM, HEADS, SHAPES, MaskReference

#: The scattered source (:func:`scattered_cases`): its densities, its mass target, the
#: method (original order, and permuted).
SCATTERED_KEEPS, SCATTERED_MASS, SCATTERED_METHOD = (0.5, 0.25, 0.15), 0.95, "sampled"


def _exact_coverage(mass: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per head ``[H]``: the share of its exact softmax mass ``mask`` keeps."""
    m = mask[..., : mass.shape[-1]].cpu().to(mass.dtype)
    return ((mass * m).sum((-1, -2)) / mass.sum((-1, -2)))[0]


def _permuted_reference(
    ref: MaskReference, full: MaskReference, perm: Any, clustered: torch.Tensor
) -> MaskReference:
    """The reference in ``perm``'s order from the all-heads-clustered one (``full``):
    each head's exact masses from ``full`` where clustered, else from ``ref``."""
    pick = clustered.cpu()[0][None, :, None, None]
    p = perm.__class__(
        *(
            t.cpu() if isinstance(t, torch.Tensor) else t
            for t in (perm.q_order, perm.k_order, perm.q_centroids, perm.k_centroids, perm.fixed)
        )
    )
    return MaskReference(
        p.permute_q(ref.q),
        p.permute_kv(ref.k),
        p.permute_kv(ref.v),
        torch.where(pick, full.mass, ref.mass),
        ref.forced,
        p.permute_q(ref.dense),
        ref.first_frame,
        ref.block_size,
    )


def _fixed_density_for(
    coverage: float, estimate: Any, mass: torch.Tensor, lo: float = 0.02, steps: int = 9
) -> tuple[float, float]:
    """The smallest density (by bisection, to ``2**-steps``) at which ``estimate(keep)``'s
    mask keeps at least ``coverage`` of the exact mass on average over heads:
    ``(density, its coverage)``."""
    hi, best = 1.0, (1.0, 1.0)
    for _ in range(steps):
        mid = (lo + hi) / 2
        mask = estimate(mid)
        cov = float(_exact_coverage(mass, mask).mean())
        if cov >= coverage:
            hi, best = mid, (float(mask.float().mean()), cov)
        else:
            lo = mid
    return best


def scattered_cases(
    device: torch.device,
    dtype: torch.dtype = torch.bfloat16,
    *,
    shape: Sequence[int] = SHAPES["wan"],
    keeps: Sequence[float] = SCATTERED_KEEPS,
    mass: float = SCATTERED_MASS,
    method: str = SCATTERED_METHOD,
    heads: int = HEADS,
    dim: int = DIM,
    block_size: int = BLOCK,
    samples: int = DEFAULT_SAMPLES,
) -> Iterator[Case]:
    """Semantic, scattered attention (:func:`ditops.bench.video_attention.scattered_attention`):
    ``method``'s masks in the video order and in the permuted order
    (:mod:`ditops.attention.permute`, as ``BlockSparseConfig(permute=True)`` runs it),
    against the oracles of both orders; per keep, then at a mass target (``mass``, the
    per-row and per-head methods of ``method``'s scores, both orders) with the fixed
    density that covers as much. Timed: the estimate with its clustering (warm-started,
    as at every step after the first) and the attention with its permutations."""
    from ditops.attention.permute import choose_heads, cluster_permutation
    from ditops.bench.video_attention import scattered_attention
    from ditops.ops.block_sparse_attention import block_sparse_attention
    from ditops.ops.estimate_block_mask import estimate_block_mask

    q, k, v = (t.to(device) for t in scattered_attention(*shape, heads=heads, dim=dim, dtype=dtype))
    seq = int(q.shape[2])
    ref = MaskReference.of(q, k, v, shape, block_size)
    ff = ref.first_frame
    cold = cluster_permutation(q, k, fixed=ff * block_size, block_size=block_size)
    full = MaskReference.of(
        cold.permute_q(q), cold.permute_kv(k), cold.permute_kv(v), shape, block_size
    )
    base = {"dense_blocks": ff, "block_size": block_size, "samples": samples}

    def sdpa() -> torch.Tensor:
        with torch.inference_mode():
            return F.scaled_dot_product_attention(q, k, v)

    def timed(name: str, opts: dict[str, Any], perm: Any, variants: dict[str, Any]) -> Any:
        """Adds ``est name`` / ``attn name``; returns the mask (in ``perm``'s order)."""
        with torch.inference_mode():
            qq, kk = (q, k) if perm is None else (perm.permute_q(q), perm.permute_kv(k))
            mask, counts = estimate_block_mask(qq, kk, **opts)

        def est() -> Any:
            with torch.inference_mode():
                if perm is None:
                    return estimate_block_mask(q, k, **opts)
                p = cluster_permutation(
                    q, k, fixed=ff * block_size, block_size=block_size, previous=perm
                )
                return estimate_block_mask(p.permute_q(q), p.permute_kv(k), **opts)

        def attn() -> torch.Tensor:
            with torch.inference_mode():
                if perm is None:
                    return block_sparse_attention(q, k, v, mask, counts, block_size=block_size)
                out = block_sparse_attention(
                    perm.permute_q(q),
                    perm.permute_kv(k),
                    perm.permute_kv(v),
                    mask,
                    counts,
                    block_size=block_size,
                )
                return perm.unpermute(out)

        variants[f"est {name}"], variants[f"attn {name}"] = est, attn
        return mask

    common = {
        "S": seq,
        "shape": list(shape),
        "first_frame_blocks": ff,
        "source": "scattered",
        "block_size": block_size,
        "dtype": str(dtype).replace("torch.", ""),
        "samples": samples,
    }
    for keep in keeps:
        variants: dict[str, Any] = {"native": sdpa}
        opts = {**base, "keep_ratio": keep, "method": method}
        with torch.inference_mode():
            perm = choose_heads(q, k, cold, block_size=block_size, keep=keep)
        plain = ref.quality(timed(method, opts, None, variants)).as_dict()
        pref = _permuted_reference(ref, full, perm, perm.clustered)
        permuted = pref.quality(timed(f"perm {method}", opts, perm, variants)).as_dict()
        # The video order's oracles with the same blocks per row (the in-budget split is
        # the same in both orders): what the permuted mode is measured against.
        for qd in (plain, permuted):
            qd["unpermuted_row_oracle_err"] = plain["row_oracle_err"]
            qd["unpermuted_head_oracle_err"] = plain["head_oracle_err"]
        permuted["clustered_heads"] = int(perm.clustered.sum())
        quality = {method: plain, f"perm {method}": permuted}
        name = f"scattered S={seq} keep={keep}"
        yield Case(
            suite="masks",
            name=name,
            variants=variants,
            params={**common, "keep": keep, "quality": quality},
        )
    # The mass target, in both orders, per row and per head; against fixed densities.
    variants = {"native": sdpa}
    quality = {}
    with torch.inference_mode():
        perm = choose_heads(q, k, cold, block_size=block_size, keep=None)
    pref = _permuted_reference(ref, full, perm, perm.clustered)
    for m in (method, f"{method}_head"):
        for order, p, r in (("", None, ref), ("perm ", perm, pref)):
            opts = {**base, "mass": mass, "method": m}
            mask = timed(f"{order}mass {m}", opts, p, variants)
            qd = r.quality(mask).as_dict()
            cov = _exact_coverage(r.mass, mask)

            def at(keep: float, p=p, m=m) -> torch.Tensor:
                qq, kk = (q, k) if p is None else (p.permute_q(q), p.permute_kv(k))
                with torch.inference_mode():
                    return estimate_block_mask(qq, kk, **{**base, "keep_ratio": keep, "method": m})[
                        0
                    ]

            fixed, fixed_cov = _fixed_density_for(float(cov.mean()), at, r.mass)
            per_head = mask[..., : r.mass.shape[-1]].float().mean((0, 2, 3)).tolist()
            qd.update(
                {
                    "coverage_per_head": cov.tolist(),
                    "coverage_min": float(cov.min()),
                    "density_per_head": per_head,
                    "fixed_density_same_mass": fixed,
                    "fixed_density_coverage": fixed_cov,
                    "unpermuted_row_oracle_err": qd["row_oracle_err"] if p is None else None,
                    "unpermuted_head_oracle_err": None,
                }
            )
            quality[f"{order}mass {m}"] = qd
    name = f"scattered S={seq} mass={mass}"
    yield Case(
        suite="masks",
        name=name,
        variants=variants,
        params={**common, "keep": None, "mass": mass, "quality": quality},
    )


def plot_scattered(summ: list[dict[str, Any]], path: str) -> None:
    """Scattered attention: output error against density, video order and permuted, each
    with its oracle; the mass targets as points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    keep_rows = [s for s in summ if s["keep"] is not None]
    for method in dict.fromkeys(s["method"] for s in keep_rows):
        pts = sorted((s["density"], s) for s in keep_rows if s["method"] == method)
        xs = [d for d, _ in pts]
        line = ax.plot(xs, [s["rel_err"] for _, s in pts], marker="o", label=method)[0]
        order = "permuted" if method.startswith("perm") else "video"
        ax.plot(
            xs,
            [s["row_oracle_err"] for _, s in pts],
            ls="--",
            color=line.get_color(),
            label=f"oracle, {order} order",
        )
    for s in summ:
        if s["keep"] is None:
            ax.plot(
                s["density"],
                s["rel_err"],
                marker="*",
                ms=10,
                ls="",
                label=f"{s['method']} ({s['mass_kept']:.3f} of the mass)",
            )
    ax.set(
        xlabel="block density",
        ylabel="output rel. L2 error against dense",
        title="scattered semantic attention",
        yscale="log",
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}", file=sys.stderr)
