"""sglang's own runtime with ditops: a tiny sglang Wan DiT forward (fp32, bitwise against
sglang's native expression), and sglang's ``DiffGenerator`` on a tiny Wan checkpoint
written here, dense and sparse."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.sglang.helpers import current_platform, ditops_platform, native_expression, switch
from tests.sglang.tiny_wan import write_tiny_wan

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
WAN = dict(
    num_attention_heads=2, attention_head_dim=32, in_channels=16, out_channels=16, text_dim=32,
    freq_dim=32, ffn_dim=128, num_layers=2, patch_size=(1, 2, 2), cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=64,
)  # fmt: skip


def _env(switch: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "DITOPS_SGLANG"}
    if switch is not None:
        env["DITOPS_SGLANG"] = switch
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_wan(tmp_path_factory.mktemp("tiny_wan"))


@pytest.fixture(scope="module")
def wan_pair(checkpoint: Path):
    """The same tiny sglang Wan DiT twice: under ditops' platform, and under one whose
    ops all take ``forward_native`` (sglang's native expression)."""
    from sglang.multimodal_gen.configs.models.dits.wanvideo import WanVideoConfig
    from sglang.multimodal_gen.runtime.distributed import parallel_state
    from sglang.multimodal_gen.runtime.models.dits.wanvideo import WanTransformer3DModel
    from sglang.multimodal_gen.runtime.platforms import PlatformEnum
    from sglang.multimodal_gen.runtime.platforms.cpu import CpuPlatform
    from sglang.multimodal_gen.runtime.server_args import ServerArgs, set_global_server_args
    from sglang.multimodal_gen.runtime.server_args import server_args as module

    class NativePlatform(CpuPlatform):  # out of tree, nothing under "native": forward_oot
        _enum = PlatformEnum.OOT

        def get_dispatch_key_name(self) -> str:
            return "native"

    saved = module._global_server_args
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29547")
    set_global_server_args(ServerArgs.from_kwargs(model_path=str(checkpoint), num_gpus=1))
    parallel_state.maybe_init_distributed_environment_and_model_parallel(1, 1)

    def build():
        config = WanVideoConfig()
        config.update_model_arch(WAN)
        return WanTransformer3DModel(config, WAN)

    with ditops_platform():
        mine = build()
    with current_platform(NativePlatform()), switch(False):
        ref = build()
    g = torch.Generator().manual_seed(0)
    for p in mine.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.05)
    ref.load_state_dict(mine.state_dict())
    yield mine, ref, NativePlatform
    module._global_server_args = saved


def test_tiny_wan_dit_forward_is_sglang_s_native_expression_in_fp32(wan_pair) -> None:
    from sglang.multimodal_gen.runtime.layers import layernorm as ln
    from sglang.multimodal_gen.runtime.managers.forward_context import set_forward_context

    from ditops.integrations.sglang import norms

    mine, ref, native = wan_pair
    assert isinstance(mine.blocks[0].norm1, ln.LayerNormScaleShift)
    assert mine.blocks[0].norm1._forward_method.func is norms.layer_norm_scale_shift_forward
    g = torch.Generator().manual_seed(1)
    x, context = torch.randn(1, 16, 3, 8, 8, generator=g), torch.randn(1, 7, 32, generator=g)
    t = torch.tensor([500])
    with torch.no_grad(), set_forward_context(current_timestep=0, attn_metadata=None):
        with ditops_platform():
            out = mine(x, context, t)
        with current_platform(native()), switch(False), native_expression():
            want = ref(x, context, t)
    assert torch.isfinite(out).all() and torch.equal(out, want)


def test_stock_sglang_stops_at_the_first_norm_on_this_cpu(wan_pair) -> None:
    """What stock sglang does here (no CPU build of sgl-kernel is served by any registry)."""
    from sglang.multimodal_gen.runtime.layers import layernorm as ln
    from sglang.multimodal_gen.runtime.platforms.cpu import CpuPlatform

    with current_platform(CpuPlatform()), switch(False):
        norm = ln.LayerNormScaleShift(64, eps=1e-6)
        x = torch.randn(1, 4, 64)
        with pytest.raises((AttributeError, ModuleNotFoundError), match="sgl_kernel"):
            norm(x, torch.zeros(1, 1, 64), torch.zeros(1, 1, 64))


@pytest.mark.slow
def test_diff_generator_runs_a_tiny_wan_dense_and_sparse(checkpoint: Path, tmp_path: Path) -> None:
    """sglang's whole pipeline (its scheduler and worker processes) with DITOPS_SGLANG=1:
    the default attention, and block_sparse_attn at sparsity 0.5 from step 1. Both runs at
    once (they are mostly start-up)."""
    config = json.dumps({"sparsity": 0.5, "skip_first_steps": 1, "block_size": 16})
    runs = {
        "dense": [str(tmp_path / "dense.npy")],
        "sparse": [str(tmp_path / "sparse.npy"), "block_sparse_attn", config],
    }
    procs = {
        name: subprocess.Popen(
            [sys.executable, str(HERE / "run_generator.py"), str(checkpoint), *argv],
            env={**_env("1"), "RUN_GENERATOR_PORT_BASE": str(port)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for (name, argv), port in zip(runs.items(), (31100, 31200))
    }
    logs = {name: proc.communicate(timeout=600)[0] for name, proc in procs.items()}
    for name, proc in procs.items():
        assert proc.returncode == 0, f"{name} run failed:\n{logs[name][-4000:]}"
    assert "Attention backends for transformer: block_sparse_attn" in logs["sparse"]
    dense, sparse = np.load(tmp_path / "dense.npy"), np.load(tmp_path / "sparse.npy")
    assert dense.shape == sparse.shape == (9, 128, 128, 3)
    assert np.isfinite(dense).all() and np.isfinite(sparse).all()
    diff = np.abs(dense - sparse)
    assert diff.max() > 0, "the sparse run computed the dense one"
    assert diff.mean() < 0.02 * np.abs(dense).mean(), "the sparse run strayed from the dense"
