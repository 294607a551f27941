"""ditops' ``block_sparse_attn`` backend: selection, per-step metadata, dense before
``skip_first_steps``, mask reuse per layer and guidance branch, refusals, the NPU path."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from sglang.multimodal_gen.runtime.managers.forward_context import set_forward_context
from sglang.multimodal_gen.runtime.platforms import AttentionBackendEnum
from sglang.multimodal_gen.runtime.server_args import set_global_server_args

from ditops.attention import BlockSparseConfig
from ditops.integrations.sglang import attention as backend
from ditops.integrations.sglang import plugin
from ditops.layers.sparse_attention import BlockSparseAttention
from tests.sglang.helpers import ditops_platform

LATENT = [1, 16, 6, 8, 16]  # B, C, F, H, W: 6 frames of 4 x 8 tokens at patch (1, 2, 2)
PATCH = (1, 2, 2)


@pytest.fixture
def server_config():
    """Sets sglang's global server args with a given --attention-backend-config."""
    from sglang.multimodal_gen.runtime.server_args import server_args as module

    saved = module._global_server_args

    def _set(config: dict | None) -> None:
        args = types.SimpleNamespace(attention_backend="block_sparse_attn")
        args.attention_backend_config = config
        set_global_server_args(args)  # type: ignore[arg-type]

    yield _set
    module._global_server_args = saved


def test_the_backend_reports_the_sglang_enum() -> None:
    """sglang's ``AttentionBackendEnum`` is closed: reporting ``BLOCK_SPARSE_ATTN`` makes
    its denoising stage build our per-step metadata (selection: test_plugin.py)."""
    assert backend.DitopsBlockSparseBackend.get_enum() is AttentionBackendEnum.BLOCK_SPARSE_ATTN


def test_builder_gives_each_step_its_metadata(server_config) -> None:
    server_config({"sparsity": 0.5, "skip_first_steps": 2, "block_size": 16, "estimate_every": 2})
    builder = backend.DitopsBlockSparseBackend.get_builder_cls()()
    md = builder.build(
        current_timestep=3, skip_first_steps=2, sparsity=0.5, raw_latent_shape=LATENT,
        patch_size=PATCH,
    )  # fmt: skip
    assert isinstance(md, backend.DitopsBlockSparseMetadata)
    assert md.current_timestep == 3 and md.skip_first_steps == 2 and md.sparsity == 0.5
    assert md.config == BlockSparseConfig(
        sparsity=0.5, skip_first_steps=2, block_size=16, estimate_every=2
    )
    assert md.dense_blocks == 2  # a frame is 4 x 8 = 32 tokens: two blocks of 16


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"sparsity": 0.5, "topk": 3}, "unknown.*topk.*supported: sparsity, skip_first_steps"),
        ({"sparsity": 1.0}, r"sparsity must be in \[0, 1\)"),
        ({"method": "magic"}, "method"),
    ],
)
def test_bad_options_are_refused_at_start_up(server_config, config, match) -> None:
    args = types.SimpleNamespace(attention_backend="block_sparse_attn")
    args.attention_backend_config = config  # as sglang has parsed it
    with ditops_platform(), pytest.raises(ValueError, match=match):
        plugin.check_server_args(None, args)  # as sglang builds its arguments
    server_config(config)
    with pytest.raises(ValueError, match=match):
        backend.DitopsBlockSparseImpl(2, 32, False, 32**-0.5, prefix="blocks.0.attn1")


def test_npu_block_sizes_are_the_kernels() -> None:
    with pytest.raises(ValueError, match="sgl-kernel-npu's kernels take"):
        backend.config_from({"block_size": 64}, "npu")
    assert backend.config_from({"block_size": 256}, "npu").block_size == 256


def _qkv(seed: int, length: int = 192, heads: int = 2, dim: int = 32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, length, heads, dim, generator=g) for _ in range(3)]


def _sdpa(q, k, v, scale):
    out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), scale=scale)
    return out.transpose(1, 2)


def _run(impl, step: int, qkv, negative: bool = False, config=None):
    md = backend.DitopsBlockSparseMetadataBuilder().build(
        current_timestep=step, skip_first_steps=config["skip_first_steps"],
        sparsity=config["sparsity"], raw_latent_shape=LATENT, patch_size=PATCH,
    )  # fmt: skip
    batch = types.SimpleNamespace(is_cfg_negative=negative)
    with set_forward_context(current_timestep=step, attn_metadata=md, forward_batch=batch):
        return impl.forward(*qkv, md)


def test_dense_before_skip_first_steps_then_sparse(server_config) -> None:
    config = {"sparsity": 0.5, "skip_first_steps": 2, "block_size": 16}
    server_config(config)
    impl = backend.DitopsBlockSparseImpl(2, 32, False, 32**-0.5, prefix="blocks.0.attn1")
    qkv = _qkv(0)
    dense = _sdpa(*qkv, 32**-0.5)
    for step in (0, 1):
        torch.testing.assert_close(_run(impl, step, qkv, config=config), dense)
    sparse = _run(impl, 2, qkv, config=config)
    assert not torch.allclose(sparse, dense, atol=1e-4)
    # What ditops' own layer computes at that step, first frame (2 blocks) kept dense.
    layer = BlockSparseAttention(BlockSparseConfig(**config))
    want = layer(*qkv, layout="BSND", scale=32**-0.5, step=2, dense_blocks=2)
    assert torch.equal(sparse, want)


def test_masks_are_reused_per_layer_and_guidance_branch(server_config, monkeypatch) -> None:
    config = {"sparsity": 0.5, "skip_first_steps": 0, "block_size": 16, "estimate_every": 2}
    server_config(config)
    from ditops.layers import sparse_attention

    estimates: list[tuple[int, float]] = []
    real = sparse_attention.estimate_block_mask

    def spy(q, k, **kw):
        estimates.append((id(q), float(q.sum())))
        return real(q, k, **kw)

    monkeypatch.setattr(sparse_attention, "estimate_block_mask", spy)
    layers = [backend.DitopsBlockSparseImpl(2, 32, False, 32**-0.5) for _ in range(2)]
    for step in range(4):
        for layer in layers:
            for negative in (False, True):
                _run(layer, step, _qkv(step * 10 + negative), negative, config)
    # Steps 0 and 2 estimate; 1 and 3 reuse: 2 layers x 2 branches x 2 estimating steps.
    assert len(estimates) == 8


def test_cross_attention_reaching_the_backend_runs_dense_with_one_warning(
    server_config, caplog
) -> None:
    config = {"sparsity": 0.5, "skip_first_steps": 0, "block_size": 16}
    server_config(config)
    impl = backend.DitopsBlockSparseImpl(2, 32, False, 32**-0.5, prefix="blocks.0.attn2")
    q = _qkv(1)[0]
    k, v = _qkv(2, length=7)[:2]
    out = _run(impl, 1, (q, k, v), config=config)
    torch.testing.assert_close(out, _sdpa(q, k, v, 32**-0.5))


def test_the_npu_path_runs_through_ditops_npu_doubles(server_config, on_npu) -> None:
    """CPU tensors take ditops' ``npu`` paths (tests/doubles: sgl-kernel-npu's documented
    contract); the backend calls them as ditops does everywhere."""
    import tests.doubles.npu_sparse_attention  # noqa: F401  (adds the sparse kernels)
    from tests.doubles.npu_sgl_kernel import fake_sgl_kernel_npu

    # The NPU estimate kernel scores antidiagonals (ditops' default method, sampled, runs
    # its meaning there).
    config = {"sparsity": 0.5, "skip_first_steps": 1, "block_size": 128, "method": "antidiagonal"}
    server_config(config)
    qkv = [t.bfloat16() for t in _qkv(3, length=2048, dim=64)]  # 16 x 16 blocks
    with ditops_platform("npu"), fake_sgl_kernel_npu() as calls, torch.no_grad():
        impl = backend.DitopsBlockSparseImpl(2, 64, False, 64**-0.5)
        dense = _run(impl, 0, qkv, config=config)
        assert calls.calls == []  # step 0: dense SDPA
        out = _run(impl, 1, qkv, config=config)
    assert len(calls.of("sparse_block_estimate")) == 1
    assert len(calls.of("ada_block_sparse_attention")) == 1
    assert out.shape == qkv[0].shape and torch.isfinite(out.float()).all()
    assert not torch.equal(out, dense)
