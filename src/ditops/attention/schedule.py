"""When and how sparse attention runs during denoising: a validated config.

Early denoising steps shape the whole video, so they run dense attention
(``skip_first_steps``); after that each attention call estimates a block mask and
runs block-sparse attention keeping about ``1 - sparsity`` of the key blocks per
query block (the estimator's top-k cap). ``sparsity == 0`` means dense attention at
every step. The first video frame is kept dense in rows and columns
(:func:`first_frame_dense_blocks`), as sglang's NPU backend does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def _check_int(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def _check_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if math.isnan(value):
        raise ValueError(f"{name} must be a number, got NaN")
    return float(value)


@dataclass(frozen=True)
class BlockSparseConfig:
    """Settings of :class:`ditops.layers.attention.BlockSparseAttention`.

    Attributes:
        sparsity: share of key blocks dropped per query block, in ``[0, 1)``; the
            estimator keeps ``int(candidates * (1 - sparsity))`` scored blocks (plus
            sink, recent and first-frame blocks) once a row has 10 candidates.
            0 runs dense attention.
        skip_first_steps: denoising steps ``0 .. skip_first_steps - 1`` run dense.
        block_size: tokens per block (rows and columns of the block mask), a multiple
            of ``stride``.
        stride: the estimator's antidiagonal stride.
        threshold: cumulative softmax mass a row keeps before the cap, in ``(0, 1]``
            (1 keeps every block the cap allows).
        keep_sink: always keep key block 0.
        keep_recent: always keep the last candidate key block.
        causal: causal attention (video DiTs are not causal).
    """

    sparsity: float = 0.0
    skip_first_steps: int = 0
    block_size: int = 128
    stride: int = 8
    threshold: float = 1.0
    keep_sink: bool = True
    keep_recent: bool = True
    causal: bool = False

    def __post_init__(self) -> None:
        sparsity = _check_float("sparsity", self.sparsity)
        if not 0.0 <= sparsity < 1.0:
            raise ValueError(f"sparsity must be in [0, 1), got {self.sparsity}")
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
        for name in ("keep_sink", "keep_recent", "causal"):
            _check_bool(name, getattr(self, name))

    @property
    def keep_ratio(self) -> float:
        """``1 - sparsity``: the estimator's cap on the share of scored blocks kept."""
        return 1.0 - float(self.sparsity)

    def dense_at(self, step: int | None) -> bool:
        """Whether denoising step ``step`` runs dense attention.

        ``step`` may be ``None`` (unknown) only when ``skip_first_steps`` is 0.
        """
        if self.sparsity == 0:
            return True
        if self.skip_first_steps == 0:
            return False
        if step is None:
            raise ValueError(
                f"skip_first_steps={self.skip_first_steps} needs the denoising step index: "
                "pass step= or call set_step() on the attention module"
            )
        _check_int("step", step, 0)
        return step < self.skip_first_steps


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
    if isinstance(patch_size, int):
        ph = pw = patch_size
    else:
        patch = [int(p) for p in patch_size]
        if len(patch) not in (2, 3):
            raise ValueError(
                f"patch_size must be an int, (ph, pw) or (pt, ph, pw), got {list(patch_size)}"
            )
        ph, pw = patch[-2], patch[-1]
    if ph < 1 or pw < 1:
        raise ValueError(f"patch sizes must be positive, got {patch_size!r}")
    _check_int("block_size", block_size, 1)
    height, width = shape[-2], shape[-1]
    if height < ph or width < pw:
        raise ValueError(f"a frame of {height}x{width} latents is smaller than the patch {ph}x{pw}")
    frame_tokens = (height // ph) * (width // pw)
    return math.ceil(frame_tokens / block_size)
