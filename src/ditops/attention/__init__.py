"""Block-sparse attention building blocks: masks, estimation, the reference, the schedule.

Plain PyTorch, no dispatch: the ops and the layer that use these live in
:mod:`ditops.ops.estimate_block_mask`, :mod:`ditops.ops.block_sparse_attention` and
:mod:`ditops.layers.sparse_attention`.
"""

from __future__ import annotations

from ditops.attention.block_mask import (
    MaskDensity,
    causal_candidates,
    density_stats,
    num_blocks,
    row_counts,
    to_flex_block_mask,
    validate_block_mask,
)
from ditops.attention.estimate import estimate_block_mask_reference
from ditops.attention.mass import covered_mass
from ditops.attention.reference import block_sparse_attention_reference
from ditops.attention.schedule import BlockSparseConfig, first_frame_dense_blocks

__all__ = [
    "BlockSparseConfig",
    "MaskDensity",
    "block_sparse_attention_reference",
    "causal_candidates",
    "covered_mass",
    "density_stats",
    "estimate_block_mask_reference",
    "first_frame_dense_blocks",
    "num_blocks",
    "row_counts",
    "to_flex_block_mask",
    "validate_block_mask",
]
