"""When and how sparse attention runs during denoising: a validated config.

Early denoising steps shape the whole video, so they run dense attention
(``skip_first_steps``); after that each attention call runs block-sparse attention
over ``1 - sparsity`` of the attention's blocks, with a block mask estimated from q and
k every ``estimate_every`` sparse steps (reused in between). ``sparsity == 0`` means
dense attention at every step. The first video frame is kept dense in rows and columns
(:func:`first_frame_dense_blocks`), as sglang's NPU backend does; by default those
blocks, like the sink and recent ones, count against the budget
(``forced_blocks="in_budget"``), so the density that runs is the one asked for.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ditops.attention.methods import DEFAULT_METHOD, DEFAULT_SAMPLES, check_method
from ditops.attention.selection import FORCED_BLOCKS, BlockSelection
from ditops.core.checks import as_bool, as_int, as_real


def _check_int(name: str, value: object, low: int) -> int:
    """An integer of any type (numpy's too; not a bool) >= ``low``, as a Python int."""
    number = as_int(value)
    if number is None:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if number < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return number


def _check_bool(name: str, value: object) -> bool:
    """A bool (numpy's too, a 0-d bool array or tensor), as a Python bool."""
    flag = as_bool(value)
    if flag is None:
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return flag


def _check_float(name: str, value: object) -> float:
    """A real number (numpy's too; not a bool) a float holds exactly, as a Python float."""
    number = as_real(value)
    if number is None:
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if math.isnan(number):
        raise ValueError(f"{name} must be a number, got NaN")
    return number


@dataclass(frozen=True)
class BlockSparseConfig:
    """Settings of :class:`ditops.layers.sparse_attention.BlockSparseAttention`.

    Attributes:
        sparsity: share of the attention's blocks skipped, in ``[0, 1)`` (the density
            ``1 - sparsity`` is in ``(0, 1]``). With ``forced_blocks="in_budget"`` (the
            default) it holds over each head's whole block map, first-frame, sink and
            recent blocks included: the estimator's budget shrinks to pay for them, and
            the realised density is ``1 - sparsity`` to within one block. When the
            forced blocks alone are more than that, only they run and ditops warns once
            with the smallest density reachable at that shape. 0 runs dense attention.
        forced_blocks: ``"in_budget"`` (above) or ``"on_top"``: sglang's reading, for
            comparing with its NPU results: the estimator keeps
            ``int(candidates * (1 - sparsity))`` scored blocks per row (once a row has
            10 candidates) and the sink, recent and first-frame blocks come on top, so
            the density that runs is above ``1 - sparsity``.
        estimate_every: estimate the block masks at every ``estimate_every``-th sparse
            step and reuse them in between (>= 1; 1 estimates at every step). Masks are
            kept per layer and guidance branch (int8, one per layer and branch); they are
            dropped when the step index does not move forward (a new pipeline call) or
            the shapes change. Reuse needs the step index: with none, every call
            estimates.
        skip_first_steps: denoising steps ``0 .. skip_first_steps - 1`` run dense.
        block_size: tokens per block (rows and columns of the block mask), a multiple
            of ``stride``.
        stride: the estimator's antidiagonal stride.
        threshold: cumulative softmax mass a row keeps before the cap, in ``(0, 1]``
            (1 keeps every block the cap allows).
        keep_sink: always keep key block 0.
        keep_recent: always keep the last candidate key block.
        causal: causal attention (video DiTs are not causal).
        method: how the estimator scores blocks and spends the budget
            (:data:`ditops.attention.methods.METHODS`): ``"sampled"`` (the default:
            ``samples`` query rows of each block attend exactly to every key, the budget
            split over the rows), ``"sampled_head"`` (the same scores, the budget spent
            over each head's whole map), ``"antidiagonal"`` (XAttention's strided
            antidiagonal scores, per row: what the Triton and NPU kernels compute; the
            default before), ``"antidiagonal_head"``, ``"sampled_layer"`` (the budget
            spent over all heads of the call at once: the layer's density is the one
            asked, a head's may differ; refused under context parallelism). Where a
            device's estimate kernel cannot compute a method, the meaning (plain torch)
            runs there, with the reason in ``explain_call``.
        samples: query rows per block the sampled scores read (>= 1).
        mass: a mass target instead of a density, in ``(0, 1]`` (``None``: use
            ``sparsity``). Each sparse call keeps the fewest blocks whose estimated
            softmax mass covers this share of each query block row's (per-row methods)
            or of each head's on average over its rows (``*_head`` methods), the forced
            blocks counted (:func:`ditops.attention.mass.select_by_mass`): every
            head gets the density it needs, local heads few blocks, diffuse heads more.
            The density that results is the mask's that runs
            (:meth:`~ditops.layers.sparse_attention.BlockSparseAttention.last_density`,
            ``ditops.sparse_densities(model)``). The mass is the *estimate's* (sampled
            rows see a row's mass in part): the mass covered in truth may be a few
            hundredths less on some heads; :func:`ditops.attention.covered_mass`
            measures it. Give ``sparsity`` or ``mass``, not both; ``mass=1`` runs dense attention.
            Needs ``threshold=1``, ``forced_blocks="in_budget"`` and a per-row or
            per-head method (not ``"sampled_layer"``).
        permute: the permuted mode (:mod:`ditops.attention.permute`, after Sparse
            VideoGen 2): per call, batch entry and head, the queries and the keys are
            clustered by k-means on their vectors (warm-started from the same layer and
            guidance branch's previous step, so it needs the step index to reuse
            anything), the tokens sorted so every cluster is contiguous, the mask
            estimated and block-sparse attention run in that order with the same ops,
            and the output put back in the original order. Related tokens scattered over
            the video then share blocks, so a density keeps more of the attention. The
            first ``dense_blocks`` blocks (first frame, text) stay in place and dense.
            A flag rather than a method: it composes with every method, a density or a
            mass target, and mask reuse (``estimate_every`` reuses the permutation with
            the mask). Not with ``causal`` (sorting tokens breaks causal order).
        clusters: k-means clusters of the queries and of the keys per head in the
            permuted mode (>= 0; 0: one per block of the permuted tokens).
    """

    sparsity: float = 0.0
    skip_first_steps: int = 0
    block_size: int = 128
    stride: int = 8
    threshold: float = 1.0
    keep_sink: bool = True
    keep_recent: bool = True
    causal: bool = False
    forced_blocks: str = "in_budget"
    estimate_every: int = 1
    method: str = DEFAULT_METHOD
    samples: int = DEFAULT_SAMPLES
    mass: float | None = None
    permute: bool = False
    clusters: int = 0

    def __post_init__(self) -> None:
        # Numbers of any type (numpy's) are kept as Python ints and floats: equal configs
        # compare and hash equal, and repr reads as the user wrote them.
        for name in ("sparsity", "threshold"):
            object.__setattr__(self, name, _check_float(name, getattr(self, name)))
        for name, low in (("skip_first_steps", 0), ("block_size", 1), ("stride", 1),
                          ("estimate_every", 1), ("samples", 1), ("clusters", 0)):  # fmt: skip
            value = getattr(self, name)
            number = as_int(value)
            if number is not None and number >= low:
                object.__setattr__(self, name, number)
        sparsity = _check_float("sparsity", self.sparsity)
        if self.mass is not None and sparsity != 0.0:
            raise ValueError(
                f"BlockSparseConfig: give sparsity (a density 1 - sparsity) or mass (a "
                f"covered share of attention mass), not both (got sparsity={self.sparsity}, "
                f"mass={self.mass!r})"
            )
        if not 0.0 <= sparsity < 1.0:
            raise ValueError(
                f"sparsity must be in [0, 1) (a density 1 - sparsity in (0, 1]), "
                f"got {self.sparsity}"
            )
        if self.forced_blocks not in FORCED_BLOCKS:
            raise ValueError(
                f"forced_blocks must be one of {FORCED_BLOCKS}, got {self.forced_blocks!r}"
            )
        _check_int("estimate_every", self.estimate_every, 1)
        _check_int("skip_first_steps", self.skip_first_steps, 0)
        _check_int("stride", self.stride, 1)
        _check_int("block_size", self.block_size, 1)
        if self.block_size % self.stride:
            raise ValueError(
                f"block_size must be a multiple of stride={self.stride}, got {self.block_size}"
            )
        threshold = _check_float("threshold", self.threshold)
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1], got {self.threshold}")
        for name in ("keep_sink", "keep_recent", "causal", "permute"):
            object.__setattr__(self, name, _check_bool(name, getattr(self, name)))
        _check_int("clusters", self.clusters, 0)
        if self.permute and self.causal:
            raise ValueError(
                "permute=True sorts tokens by cluster, which breaks causal order: use "
                "permute=False with causal=True"
            )
        check_method(
            self.method,
            self.samples,
            forced_blocks=self.forced_blocks,
            threshold=threshold,
            where="BlockSparseConfig",
        )
        if self.mass is not None:
            sel = BlockSelection(
                threshold=threshold, forced_blocks=self.forced_blocks, method=self.method,
                samples=self.samples, mass=self.mass, where="BlockSparseConfig",
            )  # fmt: skip
            object.__setattr__(self, "mass", sel.mass)

    @property
    def keep_ratio(self) -> float:
        """``1 - sparsity``: the density asked for (the estimator's ``keep_ratio``)."""
        return 1.0 - float(self.sparsity)

    def dense_at(self, step: int | None) -> bool:
        """Whether denoising step ``step`` runs dense attention.

        ``step`` may be ``None`` (unknown) only when ``skip_first_steps`` is 0.
        """
        if self.mass is not None:
            if self.mass >= 1.0:  # every block: dense attention is the same, cheaper
                return True
        elif self.sparsity == 0:
            return True
        if self.skip_first_steps == 0:
            return False
        if step is None:
            raise ValueError(
                f"skip_first_steps={self.skip_first_steps} needs the denoising step index: "
                "pass step= or call set_step() on the attention module"
            )
        return _check_int("step", step, 0) < self.skip_first_steps


def first_frame_dense_blocks(
    latent_shape: Sequence[int], patch_size: int | Sequence[int], block_size: int = 128
) -> int:
    """Blocks covering the first video frame's tokens: ``ceil(frame_tokens / block_size)``.

    Args:
        latent_shape: the latent video's shape, ending in ``(frames, height, width)``
            (e.g. ``[B, C, F, H, W]``).
        patch_size: the transformer's patch size: an int (spatial), ``(ph, pw)`` or
            ``(pt, ph, pw)``. A frame has ``(H // ph) * (W // pw)`` tokens, as the patch
            embedding computes them.
    """
    shape = [int(s) for s in latent_shape]
    if len(shape) < 3 or min(shape[-3:]) < 1:
        raise ValueError(
            f"latent_shape must end in positive (frames, height, width), got {list(latent_shape)}"
        )
    single = as_int(patch_size)
    if single is not None:
        ph = pw = single
    else:
        patch = [int(p) for p in patch_size]
        if len(patch) not in (2, 3):
            raise ValueError(
                f"patch_size must be an int, (ph, pw) or (pt, ph, pw), got {list(patch_size)}"
            )
        ph, pw = patch[-2], patch[-1]
    if ph < 1 or pw < 1:
        raise ValueError(f"patch sizes must be positive, got {patch_size!r}")
    block_size = _check_int("block_size", block_size, 1)
    height, width = shape[-2], shape[-1]
    if height < ph or width < pw:
        raise ValueError(f"a frame of {height}x{width} latents is smaller than the patch {ph}x{pw}")
    frame_tokens = (height // ph) * (width // pw)
    return math.ceil(frame_tokens / block_size)
