"""The Triton estimate (block scores + the native selection), run through Triton's interpreter.

Tolerances and the near-tie criterion are in tests/attention/estimate_ties.py (shared
with benchmarks/gpu/estimate.py): block scores within ``rtol * native + 1e-6``, ``u``
the unit roundoff of the input dtype, ``rtol`` = ``2u`` for ``passes=2`` (native's
roundings repeated; fp32 summation orders can move a rounded per-row sum by one ulp),
``4u`` for ``passes=1`` (probabilities rounded before normalisation), ``1e-5`` for fp32;
masks equal to native's except at near-ties. The criterion is checked to fail real
differences (:func:`test_the_tie_criterion_rejects_real_differences`).

Shapes are small: the interpreter is slow (~0.1-0.5 s a call here).
"""

from __future__ import annotations

import pytest
import torch

import ditops
from ditops import config
from ditops.attention.block_mask import causal_candidates, row_counts
from ditops.attention.estimate import block_scores as native_block_scores
from ditops.custom_op import reset_state
from ditops.kernels.triton import estimate as tes
from ditops.ops.estimate_block_mask import estimate_block_mask
from tests.attention.estimate_ties import ATOL, near_tie_violations, rtol, scored_blocks

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
SMALL = {"block_size": 32, "stride": 4}


def make_qk(heads, kv_heads, q_len, kv_len=None, dim=24, dtype=BF16, seed=0, spread=1.0):
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(1, heads, q_len, dim, generator=gen) * spread).to(dtype)
    k = (torch.randn(1, kv_heads, kv_len or q_len, dim, generator=gen) * spread).to(dtype)
    return q, k


def both_scores(q, k, *, causal, passes=1, block_size=32, stride=4, tiles=None):
    """(triton, native) block scores of BNSD q/k at the default softmax scale."""
    scale = int(q.shape[-1]) ** -0.5 / stride
    want = native_block_scores(
        q, k, block_size=block_size, stride=stride, score_scale=scale, causal=causal
    )
    if tiles is None:
        got = tes.block_scores(
            q,
            k,
            block_size=block_size,
            stride=stride,
            score_scale=scale,
            causal=causal,
            passes=passes,
        )
    else:
        got = torch.zeros_like(want)
        tes.launch(
            q * scale,
            k,
            got,
            block_size=block_size,
            stride=stride,
            causal=causal,
            passes=passes,
            tiles=tiles,
        )
    return got, want


def assert_scores_close(got, want, dtype, passes, causal):
    """Within the tolerance on causal candidates (NaN where native has NaN); 0 elsewhere."""
    assert got.shape == want.shape and got.dtype == FP32
    cand = torch.ones(want.shape[-2:], dtype=torch.bool)
    if causal:
        cand = causal_candidates(*want.shape[-2:])
        assert bool((got[..., ~cand] == 0).all()), "non-candidates must hold 0"
    g, w = got[..., cand], want[..., cand]
    assert torch.equal(g.isnan(), w.isnan()), "NaN in different places"
    ok = ~w.isnan()
    err = (g[ok] - w[ok]).abs()
    bound = rtol(dtype, passes) * w[ok].abs() + ATOL
    assert bool((err <= bound).all()), f"max error {float((err / bound).max()):.2f}x the bound"


# --- block scores -----------------------------------------------------------------------


@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
def test_scores_match_native(dtype, passes):
    # Odd lengths (not multiples of the stride or the block), head dim 24 (a partial
    # chunk), GQA 4/2; causal and not.
    q, k = make_qk(2, 1, 201, dtype=dtype, seed=1)
    for causal in (False, True):
        got, want = both_scores(q, k, causal=causal, passes=passes)
        assert_scores_close(got, want, dtype, passes, causal)


def test_two_pass_bf16_repeats_native_roundings():
    """passes=2 rounds where native rounds: on these inputs no sum order moves a bit."""
    q, k = make_qk(1, 1, 200, dtype=BF16, seed=2)
    got, want = both_scores(q, k, causal=False, passes=2)
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("q_len", "kv_len", "causal"), [(150, 333, False), (333, 150, True), (150, 333, True)]
)
def test_cross_lengths(q_len, kv_len, causal):
    q, k = make_qk(2, 2, q_len, kv_len, dim=16, seed=3)
    got, want = both_scores(q, k, causal=causal)
    assert_scores_close(got, want, BF16, 1, causal)


@pytest.mark.parametrize(
    ("block_size", "stride", "causal"),
    [(24, 4, False), (24, 4, True), (16, 16, True), (48, 3, False)],
)
def test_cells_not_a_power_of_two(block_size, stride, causal):
    """6, 1 and 16 strided rows per block: padding lanes in the tiles never count."""
    q, k = make_qk(2, 1, 130, dim=16, seed=4)
    got, want = both_scores(q, k, causal=causal, block_size=block_size, stride=stride)
    assert_scores_close(got, want, BF16, 1, causal)


@pytest.mark.parametrize(("passes", "causal"), [(1, True), (2, False)])
def test_many_tiles_and_workspace_groups(monkeypatch: pytest.MonkeyPatch, passes, causal):
    """Small tiles: several row and key tiles per head, two head-dim chunks (the second
    partial); passes=1 launches one head at a time when the workspace is small."""
    monkeypatch.setattr(tes, "WORKSPACE_BYTES", 1)
    q, k = make_qk(2, 1, 150, dim=24, seed=5)
    tiles = tes.Tiles(block_m=16, block_n=32, block_d=16, num_warps=4, num_stages=2)
    got, want = both_scores(q, k, causal=causal, passes=passes, tiles=tiles)
    assert_scores_close(got, want, BF16, passes, causal)


def test_peaked_softmax_fp16():
    """Large logits: most probabilities are tiny (fp16 subnormals) or exactly 0."""
    q, k = make_qk(2, 2, 260, dim=16, dtype=FP16, seed=6, spread=4.0)
    for passes in (1, 2):
        got, want = both_scores(q, k, causal=False, passes=passes)
        assert_scores_close(got, want, FP16, passes, False)


def test_strided_layouts_give_the_same_scores():
    """BNSD views of BSND memory (token stride = heads * dim) read the same values."""
    q, k = make_qk(4, 2, 210, dim=16, seed=7)
    got, _ = both_scores(q, k, causal=True)
    qs, ks = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k))
    assert not qs.is_contiguous() and torch.equal(qs, q)
    got_bsnd, _ = both_scores(qs, ks, causal=True)
    assert torch.equal(got, got_bsnd)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("passes", [1, 2])
def test_nan_spreads_as_in_native(passes):
    """A NaN query: its strided row's scores; a NaN key: every row that can see it."""
    q, k = make_qk(2, 1, 200, dim=16, seed=8)
    q[0, 0, 70, 3] = float("nan")  # strided row 17: query block 2
    k[0, 0, 100, 5] = float("nan")  # strided column 25: key block 3
    for causal in (False, True):
        got, want = both_scores(q, k, causal=causal, passes=passes)
        assert_scores_close(got, want, BF16, passes, causal)
        nan_rows = got[0, :, :, 0].isnan()
        # Query head 1 sees no NaN query; both heads read the NaN key (GQA 2/1).
        expected = torch.ones(2, 7, dtype=torch.bool) if not causal else torch.arange(7) >= 3
        expected = expected.expand(2, 7).clone()
        expected[0, 2] = True
        assert torch.equal(nan_rows, expected)


# --- masks through the op ---------------------------------------------------------------


def op_masks(q, k, **kw):
    """(triton mask, counts), (native mask, counts), on BNSD inputs given in kw's layout."""
    reset_state()
    with ditops.force_device_kind({"cpu": "cuda"}), torch.no_grad(), config.override(strict=True):
        assert estimate_block_mask.op.explain_call(q, k, **kw).chosen == "forward_cuda"
        got = estimate_block_mask(q, k, **kw)
    return got, estimate_block_mask(q, k, **kw)


CASES = {
    # keep_ratio, threshold, sink, recent, causal, dense_blocks
    "topk": (0.3, 1.0, True, True, False, 0),
    "threshold": (1.0, 0.6, False, True, False, 0),
    "both_causal": (0.4, 0.8, True, False, True, 2),
    "topk_causal_nothing_forced": (0.25, 1.0, False, False, True, 0),
}


@pytest.mark.parametrize(
    ("dtype", "case", "layout"),
    [(BF16, case, "BNSD") for case in CASES]
    + [(BF16, "topk", "BSND"), (BF16, "both_causal", "BSND")]
    + [(FP16, "threshold", "BSND"), (FP16, "both_causal", "BNSD")]
    + [(FP32, "topk", "BNSD"), (FP32, "both_causal", "BSND")],
)
def test_masks_match_native_except_near_ties(dtype, case, layout):
    keep_ratio, threshold, sink, recent, causal, dense = CASES[case]
    q, k = make_qk(4, 2, 420, dim=16, dtype=dtype, seed=9)
    opts = {
        "keep_ratio": keep_ratio,
        "threshold": threshold,
        "keep_sink": sink,
        "keep_recent": recent,
        "causal": causal,
        "dense_blocks": dense,
    }
    qi, ki = (q, k) if layout == "BNSD" else (q.transpose(1, 2), k.transpose(1, 2))
    (mask, counts), (want, want_counts) = op_masks(qi, ki, layout=layout, **opts, **SMALL)
    assert mask.dtype == torch.int8 and counts.dtype == torch.int32
    assert torch.equal(counts, row_counts(mask))
    scores = native_block_scores(q, k, score_scale=16**-0.5 / 4, causal=causal, **SMALL)
    tol = (rtol(dtype, 1), ATOL)
    assert near_tie_violations(mask, want, scores, tol, **opts) == []
    # Near-ties are rare: on these inputs at most 1% of the blocks differ.
    assert int((mask != want).sum()) <= 0.01 * mask.numel()


@pytest.mark.parametrize("forced_blocks", ["in_budget", "on_top"])
def test_the_tie_criterion_rejects_real_differences(forced_blocks):
    q, k = make_qk(2, 2, 420, dim=16, seed=10)
    opts = {
        "keep_ratio": 0.3,
        "threshold": 0.8,
        "keep_sink": True,
        "keep_recent": True,
        "causal": False,
        "forced_blocks": forced_blocks,
    }
    (mask, _), (want, _) = op_masks(q, k, **opts, **SMALL)
    scores = native_block_scores(q, k, score_scale=16**-0.5 / 4, causal=False, **SMALL)
    tol = (rtol(BF16, 1), ATOL)
    assert near_tie_violations(mask, want, scores, tol, **opts) == []
    # Drop the strongest scored block of a row, or keep its weakest: no tie explains that
    # (in a row where both stand clear of the cut).
    scored = scored_blocks(14, 14, causal=False, keep_sink=True, keep_recent=True)[0]
    for r in range(14):
        row, kept = scores[0, 0, r], want[0, 0, r].bool() & scored
        on, off = row[kept].sort(descending=True).values, row[scored & ~kept]
        gap = 4 * (tol[0] * float(row.max()) + tol[1])  # twice the criterion's tolerance
        second = float(on[1]) if on.numel() > 1 else -1.0
        if off.numel() and on.numel() and float(on[0]) - max(float(off.max()), second) > gap:
            if float(on[-1] - off.min()) > gap:
                break
    else:
        raise AssertionError("no row with a clear cut")
    strongest = int(torch.where(scored, row, -1.0).argmax())
    weakest = int(torch.where(scored, row, 2.0).argmin())
    assert want[0, 0, r, strongest] == 1 and want[0, 0, r, weakest] == 0
    for j, value in ((strongest, 0), (weakest, 1)):
        wrong = want.clone()
        wrong[0, 0, r, j] = value
        assert near_tie_violations(wrong, want, scores, tol, **opts) == [
            (0, 0, r, j, float(row[j]))
        ]


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("causal", [False, True])
def test_nan_masks_keep_only_forced_blocks_as_native(causal):
    """NaN scores are never selected: a NaN row keeps its sink, recent and dense blocks."""
    q, k = make_qk(2, 1, 300, dim=16, seed=11)
    q[0, 1, 100, 0] = float("nan")  # head 1, strided row 25: query block 3
    opts = {
        "keep_ratio": 0.3,
        "threshold": 0.9,
        "keep_sink": True,
        "keep_recent": True,
        "causal": causal,
        "dense_blocks": 1,
    }
    (mask, counts), (want, want_counts) = op_masks(q, k, **opts, **SMALL)
    assert torch.equal(mask, want) and torch.equal(counts, want_counts)
    row = torch.zeros(10, dtype=torch.int8)
    row[[0, 3 if causal else 9]] = 1  # sink (and the first frame's column), recent
    assert mask[0, 1, 3].tolist() == row.tolist()


def test_dispatch_refusals():
    q, k = make_qk(2, 2, 100, dim=16)
    reset_state()
    with ditops.force_device_kind({"cpu": "cuda"}), torch.no_grad():
        decision = estimate_block_mask.op.explain_call(q, k, block_size=256, stride=1)
        assert decision.chosen == "forward_native"
        assert any("at most 128" in r for c in decision.candidates for r in c.reasons)
        with config.override(precision="exact"):
            assert estimate_block_mask.op.explain_call(q, k).chosen == "forward_native"
        q.requires_grad_(True)
        with torch.enable_grad():
            assert estimate_block_mask.op.explain_call(q, k).chosen == "forward_native"


def test_bad_passes():
    q, k = make_qk(1, 1, 64, dim=16)
    with pytest.raises(ValueError, match="passes must be 1 or 2"):
        tes.block_scores(q, k, block_size=32, stride=4, score_scale=0.1, causal=False, passes=3)


def test_custom_op_is_registered_with_a_fake():
    q, k = make_qk(1, 1, 40, dim=16)
    torch.library.opcheck(
        torch.ops.ditops.triton_estimate_block_scores.default,
        (q, k, 32, 4, 0.05, True, 1),
        test_utils=("test_schema", "test_faketensor"),
    )
