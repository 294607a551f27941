"""Video-like attention to judge block masks by, and the two oracles they are judged against.

:func:`video_attention` makes deterministic ``q, k, v`` for tokens on a ``frames x height
x width`` grid (row-major, as a video DiT's patch embedding orders them), with heads of
four kinds, mixed in every call:

* ``spatial``: attends within its own frame, locally in (y, x);
* ``temporal``: attends to the same (y, x) in nearby frames;
* ``mixed``: local in space and time at once;
* ``diffuse``: a wide reach and flat logits, attention spread over much of the video.

Each head's logit between tokens ``i`` and ``j`` is, up to noise, ``A * kernel(p_i - p_j)``
with an anisotropic Gaussian kernel (random Fourier features: ``q = a * [cos(w.p),
sin(w.p)]``, ``k`` alike, ``w ~ N(0, 1 / reach^2)`` per axis, so ``q . k`` is a sum of
``cos(w.(p_i - p_j))``: the way RoPE'd video attention peaks where positions are close),
and ``A`` varies smoothly over the video: some regions attend sharply, others diffusely,
so rows differ in how many blocks hold their mass (what allocating a budget across rows
is about). **Global tokens**: a few keys (always token 0, plus random others, the first
frame's more often) that every query of a head attends to through a shared direction of
the last :data:`SINK_DIMS` dims, with strength varying per head: the sinks of real DiTs.
Values are random normal.

The oracles (:func:`oracle_per_row`, :func:`oracle_per_head`) know the exact softmax mass
of every block (:func:`exact_block_mass`): the best mask with the same number of blocks
in every row as a given mask, and the best with the same number in every head (rows may
then get more or fewer). Both keep the given forced blocks (first frame, sink, recent:
the policy, not the estimate's choice), so they measure the estimator's ranking and
allocation. :func:`mask_quality` compares a mask with both and with dense attention.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ditops.attention.block_mask import num_blocks
from ditops.attention.selection import forced_block_mask
from ditops.bench.accuracy import relative_error

HEAD_KINDS = ("spatial", "temporal", "mixed", "diffuse")
#: Dims of q/k carrying the global tokens' shared direction.
SINK_DIMS = 8
#: Shapes (frames, height, width) in tokens after 2x2 patching: Wan's 21 latent frames of
#: 16 x 24 (the bench default), and others no test was tuned on.
SHAPES = {
    "wan": (21, 16, 24),
    "wide": (13, 18, 40),
    "tall": (9, 30, 30),
    "long": (33, 12, 20),
}


def head_kinds(heads: int) -> list[str]:
    """The kind of each head: the four kinds in turn (``spatial`` first)."""
    return [HEAD_KINDS[h % len(HEAD_KINDS)] for h in range(heads)]


def _reach(kind: str, gen: torch.Generator) -> tuple[list[float], float]:
    """(reach per axis (t, y, x) in tokens, logit amplitude) for one head of ``kind``."""

    def u(lo: float, hi: float) -> float:
        return float(torch.empty(()).uniform_(lo, hi, generator=gen))

    if kind == "spatial":
        return [0.25, u(2.0, 7.0), u(2.0, 7.0)], u(11.0, 16.0)
    if kind == "temporal":
        return [u(2.0, 6.0), u(0.5, 1.0), u(0.5, 1.0)], u(11.0, 16.0)
    if kind == "mixed":
        return [u(1.0, 3.0), u(2.0, 5.0), u(2.0, 5.0)], u(11.0, 16.0)
    return [u(4.0, 10.0), u(6.0, 12.0), u(6.0, 12.0)], u(7.0, 10.0)


def _smooth_field(pos: torch.Tensor, gen: torch.Generator, extent: torch.Tensor) -> torch.Tensor:
    """A smooth field over the video in [0, 1]: a few long-wavelength waves."""
    freqs = torch.randn(4, 3, generator=gen) * (2 * math.pi / extent)
    phase = torch.rand(4, generator=gen) * 2 * math.pi
    f = torch.cos(pos @ freqs.T + phase).mean(-1)
    return (f - f.min()) / (f.max() - f.min() + 1e-9)


def grid_positions(frames: int, height: int, width: int) -> torch.Tensor:
    """fp32 ``[S, 3]``: (t, y, x) of each token, row-major as a patch embedding orders them."""
    t, y, x = torch.meshgrid(
        *(torch.arange(n, dtype=torch.float32) for n in (frames, height, width)), indexing="ij"
    )
    return torch.stack([t.flatten(), y.flatten(), x.flatten()], dim=-1)


def video_attention(
    frames: int,
    height: int,
    width: int,
    *,
    heads: int = 12,
    dim: int = 128,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    sinks: int = 4,
    noise: float = 0.15,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """BNSD ``q, k, v`` ``[1, heads, frames * height * width, dim]`` (see the module doc).

    Deterministic from ``seed`` (the same on every machine: CPU generator, fp32 maths).
    ``sinks``: global tokens besides token 0; ``noise``: relative noise on q and k.
    """
    if dim <= SINK_DIMS or (dim - SINK_DIMS) % 2:
        raise ValueError(f"dim must be even and > {SINK_DIMS}, got {dim}")
    gen = torch.Generator().manual_seed(seed)
    pos = grid_positions(frames, height, width)  # [S, 3]
    seq, feats = int(pos.shape[0]), (dim - SINK_DIMS) // 2
    extent = torch.tensor([frames, height, width], dtype=torch.float32)
    frame_tokens = height * width
    n_sinks = min(sinks, seq - 1)
    # Global tokens: token 0, then half from the first frame, half from anywhere.
    first = torch.randperm(max(frame_tokens - 1, 1), generator=gen)[: (n_sinks + 1) // 2] + 1
    rest = torch.randperm(seq, generator=gen)[: n_sinks - int(first.numel())]
    sink_ids = torch.unique(torch.cat([torch.zeros(1, dtype=torch.long), first, rest]))
    sink_ids = sink_ids[sink_ids < seq]
    scale = dim**-0.5
    qs, ks = [], []
    for kind in head_kinds(heads):
        reach, amp = _reach(kind, gen)
        w = torch.randn(3, feats, generator=gen) / torch.tensor(reach)[:, None]
        phase = pos @ w
        base = torch.cat([phase.cos(), phase.sin()], dim=-1)  # q.k = sum of cos(w.dp)
        # Sharp and diffuse regions: the amplitude moves smoothly between 0.4 A and A.
        sharp = 0.4 + 0.6 * _smooth_field(pos, gen, extent)
        a = torch.sqrt(amp / (feats * scale) * sharp)[:, None]
        qh = a * (base + noise * torch.randn(base.shape, generator=gen))
        kh = math.sqrt(amp / (feats * scale)) * (
            base + noise * torch.randn(base.shape, generator=gen)
        )
        # The global tokens: logit ``strength`` from every query, via a shared direction.
        strength = float(torch.empty(()).uniform_(2.0, 9.0, generator=gen))
        u = F.normalize(torch.randn(SINK_DIMS, generator=gen), dim=0)
        qsink = torch.ones(seq, 1) * u * math.sqrt(strength / scale)
        ksink = torch.zeros(seq, SINK_DIMS)
        ksink[sink_ids] = u * math.sqrt(strength / scale)
        qs.append(torch.cat([qh, qsink], dim=-1))
        ks.append(torch.cat([kh, ksink], dim=-1))
    q, k = torch.stack(qs)[None], torch.stack(ks)[None]
    v = torch.randn(q.shape, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def exact_block_mass(q: torch.Tensor, k: torch.Tensor, block_size: int = 128) -> torch.Tensor:
    """fp32 ``[B, H, Qb, KVb]``: the exact softmax mass each query block gives each key
    block, summed over the block's queries (a row sums to its number of queries). BNSD
    self- or cross-attention, no GQA."""
    batch, heads, q_len, dim = (int(s) for s in q.shape)
    kv_len = int(k.shape[2])
    qb, kb = num_blocks(q_len, block_size), num_blocks(kv_len, block_size)
    out = torch.zeros(batch, heads, qb, kb)
    col = torch.arange(kv_len) // block_size
    rows_per = max(1, (1 << 22) // max(kv_len, 1) // block_size) * block_size
    for b in range(batch):
        for h in range(heads):
            kf = k[b, h].float()
            for r0 in range(0, q_len, rows_per):
                r1 = min(q_len, r0 + rows_per)
                p = torch.softmax(q[b, h, r0:r1].float() @ kf.T * dim**-0.5, dim=-1)
                per = torch.zeros(r1 - r0, kb).index_add_(1, col, p)
                row_block = torch.arange(r0, r1) // block_size
                out[b, h].index_add_(0, row_block, per)
    return out


def _best(mass: torch.Tensor, forced: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Per row of ``mass`` (flattened as the caller wants), ``forced`` plus the best
    ``counts - forced`` other entries; int8."""
    v = mass.masked_fill(forced, float("inf"))
    order = v.argsort(dim=-1, descending=True, stable=True)
    ranks = torch.empty_like(order).scatter_(-1, order, torch.arange(v.shape[-1]).expand_as(order))
    return (ranks < counts[..., None]).to(torch.int8)


def oracle_per_row(
    mass: torch.Tensor, mask: torch.Tensor, forced: torch.Tensor | None = None
) -> torch.Tensor:
    """The best mask with ``mask``'s number of blocks in every row, keeping ``forced``
    (bool ``[Qb, KVb]``; ``None``: nothing forced): int8, as ``mask``."""
    kv = int(mass.shape[-1])
    forced = torch.zeros(mass.shape[-2:], dtype=torch.bool) if forced is None else forced
    counts = mask[..., :kv].sum(-1)
    return _best(mass, forced.expand(mass.shape), counts)


def oracle_per_head(
    mass: torch.Tensor, mask: torch.Tensor, forced: torch.Tensor | None = None
) -> torch.Tensor:
    """The best mask with ``mask``'s number of blocks in every head (over its whole map),
    keeping ``forced``: int8, as ``mask``."""
    kv = int(mass.shape[-1])
    forced = torch.zeros(mass.shape[-2:], dtype=torch.bool) if forced is None else forced
    counts = mask[..., :kv].sum(dim=(-1, -2))
    flat = _best(mass.flatten(-2), forced.expand(mass.shape).flatten(-2), counts)
    return flat.view(mass.shape)


@dataclass(frozen=True)
class MaskQuality:
    """A mask against the two oracles and against dense attention.

    ``mass_vs_row`` / ``mass_vs_head``: softmax mass inside the mask over the oracle's
    (all heads together; ``worst_head_*``: the worst head's ratio); ``mass_kept``: the
    mask's share of all the mass; ``rel_err``: ``||out - dense|| / ||dense||`` of the
    attention output, ``row_oracle_err`` / ``head_oracle_err`` the same for the
    oracles' masks; ``err_vs_row_oracle``: ``rel_err / row_oracle_err``.
    """

    density: float
    mass_kept: float
    mass_vs_row: float
    mass_vs_head: float
    worst_head_vs_row: float
    worst_head_vs_head: float
    rel_err: float
    row_oracle_err: float
    head_oracle_err: float

    @property
    def err_vs_row_oracle(self) -> float:
        return self.rel_err / self.row_oracle_err if self.row_oracle_err else float("inf")

    def as_dict(self) -> dict[str, float]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["err_vs_row_oracle"] = self.err_vs_row_oracle
        return d


def mask_quality(
    mass: torch.Tensor,
    mask: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dense: torch.Tensor,
    *,
    forced: torch.Tensor | None = None,
    block_size: int = 128,
) -> MaskQuality:
    """Score ``mask`` (``[B, H, Qb, KVb]``) on exact masses ``mass`` and on the output
    (``block_sparse_attention`` on fp32 copies: within 1e-5 of the meaning, so the
    roundings of a bf16 kernel play no part)."""
    from ditops.ops.block_sparse_attention import block_sparse_attention

    kv = int(mass.shape[-1])
    m = mask[..., :kv].to(torch.int8)
    row, head = oracle_per_row(mass, m, forced), oracle_per_head(mass, m, forced)

    def kept(x: torch.Tensor) -> torch.Tensor:
        return (mass * x).sum(dim=(-1, -2))  # [B, H]

    mine, by_row, by_head = kept(m), kept(row), kept(head)

    qf, kf, vf = q.float(), k.float(), v.float()

    def attend(x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return block_sparse_attention(
                qf, kf, vf, x, x.sum(-1, dtype=torch.int32), block_size=block_size
            )

    return MaskQuality(
        density=float(m.float().mean()),
        mass_kept=float(mine.sum() / mass.sum()),
        mass_vs_row=float(mine.sum() / by_row.sum()),
        mass_vs_head=float(mine.sum() / by_head.sum()),
        worst_head_vs_row=float((mine / by_row).min()),
        worst_head_vs_head=float((mine / by_head).min()),
        rel_err=relative_error(attend(m), dense),
        row_oracle_err=relative_error(attend(row), dense),
        head_oracle_err=relative_error(attend(head), dense),
    )


def scattered_attention(
    frames: int,
    height: int,
    width: int,
    *,
    heads: int = 12,
    dim: int = 128,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    objects: int = 12,
    cells: int = 96,
    noise: float = 0.15,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """BNSD ``q, k, v`` of video-like attention with **semantic, scattered** structure.

    Per head, ``cells`` seed points are thrown at random over the ``frames x height x
    width`` grid and each belongs to one of ``objects`` objects; a token belongs to the
    object of its nearest seed (a Voronoi cell, anisotropic: cells stretch over a few
    frames). So each object is a union of patches scattered over space and time, and
    the keys a query needs (its own object's) sit in many tiles of the video order.
    The logit between tokens ``i`` and ``j`` is, up to noise, ``A_obj * [same object]``
    plus a local Gaussian-kernel term ``A_loc * kernel(p_i - p_j)`` (random Fourier
    features, as :func:`video_attention`), plus token 0 as a global sink. Heads differ:
    ``A_obj`` from 0 (a purely local head: every 4th head) to sharp, ``A_loc`` and the
    local reach vary, so heads need different densities. Deterministic from ``seed``.
    """
    obj_dims = dim // 2
    loc_feats = (dim - obj_dims - 2) // 2
    if loc_feats < 2:
        raise ValueError(f"dim too small for scattered_attention: {dim}")
    gen = torch.Generator().manual_seed(seed)
    pos = grid_positions(frames, height, width)  # [S, 3]
    seq = int(pos.shape[0])
    scale = dim**-0.5
    # Cells stretch over time: distances in frames count a quarter.
    metric = torch.tensor([4.0, 1.0, 1.0])
    extent = torch.tensor([frames, height, width], dtype=torch.float32)
    qs, ks = [], []
    for h in range(heads):

        def u(lo: float, hi: float) -> float:
            return float(torch.empty(()).uniform_(lo, hi, generator=gen))

        seeds = torch.rand(cells, 3, generator=gen) * extent
        owner = torch.randint(0, objects, (cells,), generator=gen)
        nearest = torch.cdist(pos * metric, seeds * metric).argmin(-1)
        label = owner[nearest]  # [S]
        a_obj = 0.0 if h % 4 == 3 else u(6.0, 12.0)
        a_loc = u(3.0, 6.0) if h % 4 != 3 else u(10.0, 14.0)
        reach = torch.tensor([u(0.5, 2.0), u(1.5, 4.0), u(1.5, 4.0)])
        emb = F.normalize(torch.randn(objects, obj_dims, generator=gen), dim=-1)
        obj = emb[label]  # [S, obj_dims]; same object: dot 1, others ~ 0
        w = torch.randn(3, loc_feats, generator=gen) / reach[:, None]
        phase = pos @ w
        loc = torch.cat([phase.cos(), phase.sin()], dim=-1) / math.sqrt(loc_feats)
        a_o, a_l = math.sqrt(a_obj / scale), math.sqrt(a_loc / scale)
        qh = torch.cat([a_o * obj, a_l * loc], -1)
        kh = torch.cat([a_o * obj, a_l * loc], -1)
        qh = qh + noise * qh.norm(dim=-1, keepdim=True).mean() / math.sqrt(dim) * torch.randn(
            qh.shape, generator=gen
        )
        kh = kh + noise * kh.norm(dim=-1, keepdim=True).mean() / math.sqrt(dim) * torch.randn(
            kh.shape, generator=gen
        )
        sink_q = torch.full((seq, 2), math.sqrt(u(2.0, 6.0) / scale / 2))
        sink_k = torch.zeros(seq, 2)
        sink_k[0] = math.sqrt(1 / scale / 2) * 2**0.5
        qs.append(torch.cat([qh, sink_q], -1))
        ks.append(torch.cat([kh, sink_k], -1))
    q, k = torch.stack(qs)[None], torch.stack(ks)[None]
    v = torch.randn(q.shape, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype)


# --- what masks are scored against (the masks suite and its probes) ----------------------

#: The masks suite's heads, head dim, block size and antidiagonal stride; its forced blocks.
HEADS, DIM, BLOCK, STRIDE = 12, 128, 128, 8
FLAGS = {"keep_sink": True, "keep_recent": True, "causal": False}


def first_frame_blocks(shape: Sequence[int], block_size: int = BLOCK) -> int:
    return math.ceil(shape[1] * shape[2] / block_size)


@dataclass(frozen=True)
class MaskReference:
    """What masks of one BNSD ``q, k, v`` are scored against (fp32 CPU copies): the exact
    block masses, the forced blocks (the first frame of ``shape``, sink, recent) and the
    dense attention output."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mass: torch.Tensor
    forced: torch.Tensor
    dense: torch.Tensor
    first_frame: int
    block_size: int

    @classmethod
    def of(
        cls,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        shape: Sequence[int],
        block_size: int = BLOCK,
    ) -> MaskReference:
        qf, kf, vf = (t.float().cpu() for t in (q, k, v))
        ff = first_frame_blocks(shape, block_size)
        mass = exact_block_mass(qf, kf, block_size)
        blocks = int(mass.shape[-1])
        forced = forced_block_mask(blocks, blocks, dense_blocks=ff, **FLAGS)
        with torch.inference_mode():
            dense = F.scaled_dot_product_attention(qf, kf, vf)
        return cls(qf, kf, vf, mass, forced, dense, ff, block_size)

    def quality(self, mask: torch.Tensor) -> MaskQuality:
        """``mask`` (``[B, H, Qb, KVb]``, any device) against both oracles and dense."""
        return mask_quality(
            self.mass,
            mask.cpu(),
            self.q,
            self.k,
            self.v,
            self.dense,
            forced=self.forced,
            block_size=self.block_size,
        )
