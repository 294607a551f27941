"""Block masks: the validator's errors, FlexAttention conversion, density statistics."""

from __future__ import annotations

import pytest
import torch

from ditops.attention.block_mask import (
    causal_candidates,
    density_stats,
    num_blocks,
    row_counts,
    to_flex_block_mask,
    validate_block_mask,
)
from tests.attention.helpers import random_mask

SHAPE = {"batch": 2, "heads": 3, "q_blocks": 4, "kv_blocks": 5}


def good() -> tuple[torch.Tensor, torch.Tensor]:
    return random_mask(2, 3, 4, 5)


def test_num_blocks_covers_partial_blocks() -> None:
    assert [num_blocks(n, 128) for n in (1, 128, 129, 1000, 4097)] == [1, 1, 2, 8, 33]


def test_valid_masks_pass() -> None:
    mask, counts = good()
    validate_block_mask(mask, counts, **SHAPE)
    validate_block_mask(mask.bool(), counts, **SHAPE)
    # The NPU pads the column dim to a multiple of 32 with zeros: accepted.
    padded = torch.zeros(2, 3, 4, 32, dtype=torch.int8)
    padded[..., :5] = mask
    validate_block_mask(padded, counts, **SHAPE)


@pytest.mark.parametrize(
    ("case", "error", "message"),
    [
        ("float_mask", TypeError, "mask dtype must be int8"),
        ("int64_counts", TypeError, "counts dtype must be int32"),
        ("mask_3d", ValueError, r"mask shape must be \[B, N, Qb, >=KVb\] = \[2, 3, 4, >=5\]"),
        ("too_few_columns", ValueError, r"got \[2, 3, 4, 4\]"),
        ("counts_shape", ValueError, r"counts shape must be \[B, N, Qb\] = \[2, 3, 4\]"),
        ("value_two", ValueError, "mask values must be 0 or 1"),
        ("padding_set", ValueError, "columns past kv_blocks=5 are padding and must be 0"),
        ("counts_wrong", ValueError, r"first at \[b, n, qb\] = \[1, 2, 3\]: count 7, row sum"),
        ("device", ValueError, "mask is on meta but counts are on cpu"),
        ("not_tensor", TypeError, "must be tensors, got list"),
    ],
)
def test_validator_errors_say_what_is_wrong(case: str, error: type, message: str) -> None:
    mask, counts = good()
    if case == "float_mask":
        mask = mask.float()
    elif case == "int64_counts":
        counts = counts.long()
    elif case == "mask_3d":
        mask = mask[0]
    elif case == "too_few_columns":
        mask = mask[..., :4]
    elif case == "counts_shape":
        counts = counts[..., :3]
    elif case == "value_two":
        mask[0, 0, 1, 1] = 2
    elif case == "padding_set":
        mask = torch.cat([mask, torch.ones(2, 3, 4, 1, dtype=torch.int8)], dim=-1)
    elif case == "counts_wrong":
        counts[1, 2, 3] = 7
    elif case == "device":
        mask = mask.to("meta")
    elif case == "not_tensor":
        mask = mask.tolist()
    with pytest.raises(error, match=message):
        validate_block_mask(mask, counts, **SHAPE)


def test_value_checks_can_be_skipped() -> None:
    mask, counts = good()
    counts[0, 0, 0] = 5
    validate_block_mask(mask, counts, **SHAPE, check_values=False)
    with pytest.raises(ValueError, match="row sums"):
        validate_block_mask(mask, counts, **SHAPE)


def test_row_counts_ignore_padding_columns() -> None:
    mask = torch.tensor([[[[1, 0, 1, 1]]]], dtype=torch.int8)
    assert row_counts(mask).tolist() == [[[3]]]
    assert row_counts(mask, kv_blocks=2).tolist() == [[[1]]]
    assert row_counts(mask).dtype == torch.int32


def test_causal_candidates_are_top_left_aligned() -> None:
    c = causal_candidates(3, 4)
    assert c.tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [True, True, True, False],
    ]


@pytest.mark.parametrize("causal", [False, True])
def test_flex_block_mask_lists_selected_blocks_as_full(causal: bool) -> None:
    mask, counts = random_mask(1, 2, 8, 8, seed=3)
    bm = to_flex_block_mask(mask, counts, q_len=1000, kv_len=1000, block_size=128, causal=causal)
    assert bm.seq_lengths == (1000, 1000) and bm.BLOCK_SIZE == (128, 128)
    for n in range(2):
        for r in range(8):
            selected = mask[0, n, r].nonzero().flatten().tolist()
            full = [j for j in selected if j < r] if causal else selected
            partial = [j for j in selected if j == r] if causal else []
            c, cf = int(bm.kv_num_blocks[0, n, r]), int(bm.full_kv_num_blocks[0, n, r])
            assert bm.full_kv_indices[0, n, r, :cf].tolist() == full
            assert bm.kv_indices[0, n, r, :c].tolist() == partial
    # mask_mod (what eager FlexAttention reads) keeps exactly the selected blocks' elements.
    q = torch.arange(0, 1000, 7)[:, None]
    kv = torch.arange(0, 1000, 5)[None, :]
    for n in range(2):
        head = torch.tensor(n)
        want = mask[0, n].bool()[q // 128, kv // 128]
        if causal:
            want = want & (q >= kv)
        assert torch.equal(bm.mask_mod(torch.tensor(0), head, q, kv), want)


def test_flex_block_mask_drops_padding_columns() -> None:
    mask, counts = random_mask(1, 1, 2, 2)
    padded = torch.zeros(1, 1, 2, 32, dtype=torch.int8)
    padded[..., :2] = mask
    bm = to_flex_block_mask(padded.bool(), counts, q_len=200, kv_len=200, block_size=128)
    assert bm.full_kv_indices.shape[-1] == 2 and bm.kv_indices.shape[-1] == 2


def test_density_counts_partial_blocks_at_their_size() -> None:
    # 200 tokens in blocks of 128: sizes 128 and 72.
    mask = torch.tensor([[[[1, 0], [0, 1]], [[1, 1], [0, 0]]]], dtype=torch.int8)
    stats = density_stats(mask, q_len=200, kv_len=200, block_size=128)
    head0 = (128 * 128 + 72 * 72) / 200**2
    head1 = (128 * 200) / 200**2
    assert stats.per_head == pytest.approx([head0, head1])
    assert stats.density == pytest.approx((head0 + head1) / 2)
    assert stats.block_density == pytest.approx(0.5)
    assert stats.empty_rows == 1 and stats.min_blocks_per_row == 0
    assert stats.max_blocks_per_row == 2 and stats.mean_blocks_per_row == pytest.approx(1.0)
    assert set(stats.as_dict()) >= {"density", "per_head", "empty_rows"}


def test_causal_density_is_over_the_causal_blocks() -> None:
    mask = torch.ones(1, 1, 4, 4, dtype=torch.int8)
    stats = density_stats(mask, q_len=512, kv_len=512, block_size=128, causal=True)
    assert stats.density == pytest.approx(1.0) and stats.block_density == pytest.approx(1.0)
    assert stats.max_blocks_per_row == 4 and stats.min_blocks_per_row == 1
