"""The permuted mode on the NPU paths (the kernels of tests/doubles/npu_sparse_attention.py,
through the doubles of the legacy ``attentions`` package and of the current
``sgl_kernel_npu``).

The mode hands the ops plain contiguous BNSD tensors in the permuted order (the first
frame's blocks in place) and a dense 0/1 block mask with counts equal to its row sums:
within the kernels' contract (shared/docs/npu-attentions-ops.md), so nothing is refused.
What is asserted: ``ada_block_sparse_attention`` runs on the permuted q, k, v with the
mask estimated in that order; ``sparse_block_estimate`` runs for the antidiagonal method
(the sampled one, the default, runs the meaning: the kernel scores antidiagonals only);
the output is the block-sparse attention of the permuted tensors put back in place.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import tests.doubles.npu_sparse_attention  # noqa: F401 - registers the fake sparse ops
from ditops.layers.sparse_attention import BlockSparseAttention
from ditops.ops.block_sparse_attention import ATTENTION_TOLERANCE, block_sparse_attention
from tests.doubles.npu_attentions import Recorder, fake_attentions
from tests.doubles.npu_sgl_kernel import fake_sgl_kernel_npu


def npu_package(package: str) -> contextlib.AbstractContextManager[Recorder]:
    return fake_attentions() if package == "legacy" else fake_sgl_kernel_npu()


def scattered(seq: int = 1024, heads: int = 2, dim: int = 32, groups: int = 6):
    """bf16 q/k/v whose tokens belong to objects scattered over the sequence."""
    gen = torch.Generator().manual_seed(3)
    label = torch.randint(0, groups, (heads, seq), generator=gen)
    centres = torch.randn(heads, groups, dim, generator=gen) * 2.0
    base = torch.gather(centres, 1, label[..., None].expand(-1, -1, dim))
    q = (base + 0.2 * torch.randn(heads, seq, dim, generator=gen))[None].bfloat16()
    k = (base + 0.2 * torch.randn(heads, seq, dim, generator=gen))[None].bfloat16()
    v = torch.randint(-4, 5, (1, heads, seq, dim), generator=gen).bfloat16()
    return q, k, v


@pytest.mark.parametrize("package", ["legacy", "current"])
@pytest.mark.parametrize("method", ["antidiagonal", "sampled"])
def test_permuted_mode_runs_on_the_npu_kernels(on_npu, method: str, package: str) -> None:
    q, k, v = scattered()
    layer = BlockSparseAttention(permute=True, sparsity=0.5, method=method, dense_blocks=1)
    with npu_package(package) as calls, torch.no_grad():
        out = layer(q, k, v)
    perm, (mask, _, _) = layer._last_permutation, layer._last_run
    assert not torch.equal(perm.q_order[0, 0], torch.arange(1024))  # it did permute
    assert torch.equal(perm.q_order[..., :128], torch.arange(128).expand(1, 2, 128))
    qp, kp, vp = perm.permute_q(q), perm.permute_kv(k), perm.permute_kv(v)

    estimates = calls.of("sparse_block_estimate")
    if method == "antidiagonal":
        (est,) = estimates
        assert torch.equal(est[0], qp) and torch.equal(est[1], kp)
    else:
        assert estimates == []  # sampled rows: the meaning estimates
    (att,) = calls.of("ada_block_sparse_attention")
    assert torch.equal(att[0], qp) and torch.equal(att[1], kp) and torch.equal(att[2], vp)
    assert torch.equal(att[3], mask) and att[5] == "BNSD"
    counts = mask.sum(-1, dtype=torch.int32)
    assert torch.equal(att[4], counts)
    assert bool(mask[..., 0, :].all()) and bool(mask[..., :, 0].all())  # first frame

    with torch.no_grad():
        want = perm.unpermute(
            block_sparse_attention.op.forward_native(
                qp,
                kp,
                vp,
                mask,
                counts,
                layout="BNSD",
                scale=None,
                causal=False,
                block_size=128,
            )
        )
    atol, rtol = ATTENTION_TOLERANCE[torch.bfloat16]
    err = (out.float() - want.float()).abs()
    assert bool((err <= atol * float(v.float().abs().max()) + rtol * want.float().abs()).all())
