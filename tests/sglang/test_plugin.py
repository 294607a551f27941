"""ditops enters sglang as a general plugin (hooks), not as a platform: it composes with
whatever platform sglang picked, checks every config form when sglang builds its
arguments, and a ditops failure at model build is never swapped for diffusers' class."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
from sglang.multimodal_gen.runtime.layers import activation as act
from sglang.multimodal_gen.runtime.layers import layernorm as ln
from sglang.multimodal_gen.runtime.layers.custom_op import CustomOp
from sglang.multimodal_gen.runtime.platforms import AttentionBackendEnum, PlatformEnum
from sglang.multimodal_gen.runtime.platforms.cpu import CpuPlatform

from ditops.integrations.sglang import attention, norms, plugin
from tests.sglang.helpers import ditops_platform, install_hooks, stock_cpu_platform

HERE = Path(__file__).parent
ROOT = HERE.parent.parent


def _env(switch: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "DITOPS_SGLANG"}
    if switch is not None:
        env["DITOPS_SGLANG"] = switch
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


class VendorPlatform(CpuPlatform):
    """A vendor's out-of-tree platform (as sglang's own tests fake one)."""

    _enum = PlatformEnum.OOT

    def get_dispatch_key_name(self) -> str:
        return "vendor"


def test_ditops_is_a_general_plugin_not_a_platform() -> None:
    groups = {
        group: [e.value for e in entry_points(group=group) if e.dist and e.dist.name == "ditops"]
        for group in ("sglang.multimodal_gen.platforms", "sglang.multimodal_gen.plugins")
    }
    assert groups == {
        "sglang.multimodal_gen.platforms": [],
        "sglang.multimodal_gen.plugins": ["ditops.integrations.sglang:activate"],
    }
    code = (
        "from sglang.multimodal_gen.runtime.platforms.plugins import apply_plugin_hooks\n"
        "apply_plugin_hooks()\n"
        "from sglang.multimodal_gen.runtime.platforms import current_platform as p\n"
        "from sglang.multimodal_gen.runtime.layers import layernorm as ln\n"
        "m = ln.LayerNormScaleShift(8)\n"
        "print(type(p).__name__, p.is_out_of_tree(), getattr(m._forward_method, 'func', m._forward_method).__module__)\n"  # noqa: E501
    )
    runs = {
        s: subprocess.run(
            [sys.executable, "-c", code], env=_env(s), capture_output=True, text=True, check=True
        ).stdout.split()[-3:]
        for s in (None, "1")
    }
    assert runs[None][:2] == runs["1"][:2] == ["CpuPlatform", "False"]  # the platform stays
    assert runs["1"][2] == "ditops.integrations.sglang.norms"
    assert runs[None][2] != "ditops.integrations.sglang.norms"


def test_a_vendor_platform_keeps_its_slot_and_runs_ditops_ops() -> None:
    vendor_silu = lambda module, x: x  # noqa: E731  (the vendor's kernel for an op ditops leaves)
    CustomOp.register_oot_forward(act.SiluAndMul, fn=vendor_silu, platform_key="vendor")
    try:
        with ditops_platform(instance=VendorPlatform()):
            norm, silu = ln.LayerNormScaleShift(8), act.SiluAndMul()
            quick = act.QuickGELU()
        assert norm._forward_method.func is norms.layer_norm_scale_shift_forward
        assert silu._forward_method.func is vendor_silu
        assert quick._forward_method == quick.forward_oot  # sglang's own rule for the rest
        with stock_cpu_platform(), pytest.raises(Exception, match="sgl_kernel"):
            ln.LayerNormScaleShift(8)(torch.randn(1, 2, 8), torch.zeros(1), torch.zeros(1))
    finally:
        del CustomOp._oot_forward_registry["vendor"][act.SiluAndMul]


def test_block_sparse_attn_resolves_to_ditops_on_any_platform() -> None:
    from sglang.multimodal_gen.runtime.layers.attention import selector

    sparse = AttentionBackendEnum.BLOCK_SPARSE_ATTN
    install_hooks()
    for platform in (CpuPlatform(), VendorPlatform()):
        with ditops_platform(instance=platform):
            got = selector._cached_get_attn_backend(64, torch.bfloat16, (), sparse)
            other = selector._cached_get_attn_backend(64, torch.bfloat16, (), None)
        assert got is attention.DitopsBlockSparseBackend
        assert other.__name__ == "SDPABackend"
    with stock_cpu_platform():  # stock CPU maps every choice to SDPA
        assert selector._cached_get_attn_backend(64, torch.bfloat16, (), sparse).__name__ == (
            "SDPABackend"
        )


def _server_args(tmp_path: Path, config: object):
    from sglang.multimodal_gen.runtime.server_args import ServerArgs

    folder = tmp_path / "Wan2.1-T2V-1.3B-Diffusers"
    folder.mkdir(exist_ok=True)
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    return ServerArgs.from_kwargs(
        model_path=str(folder), num_gpus=1, attention_backend="block_sparse_attn",
        attention_backend_config=config,
    )  # fmt: skip


def test_every_config_form_is_checked_when_sglang_builds_its_arguments(tmp_path: Path) -> None:
    from sglang.multimodal_gen.runtime.server_args import server_args as module

    saved = module._global_server_args
    (tmp_path / "bad.json").write_text(json.dumps({"sparsity": 0.5, "bogus": 1}))
    (tmp_path / "bad.yaml").write_text("sparsity: 0.5\nbogus: 1\n")
    (tmp_path / "good.yaml").write_text("sparsity: 0.5\nblock_size: 16\n")
    forms = [
        '{"sparsity": 0.5, "bogus": 1}',
        "sparsity=0.5,bogus=1",
        str(tmp_path / "bad.json"),
        str(tmp_path / "bad.yaml"),
    ]
    try:
        with ditops_platform():
            for form in forms:
                with pytest.raises(
                    ValueError, match="unknown --attention-backend-config key.*bogus"
                ):
                    _server_args(tmp_path, form)
            with pytest.raises(ValueError, match=r"sparsity must be in \[0, 1\)"):
                _server_args(tmp_path, "sparsity=1.5")
            good = _server_args(tmp_path, str(tmp_path / "good.yaml"))
            assert good.attention_backend_config == {"sparsity": 0.5, "block_size": 16}
        with stock_cpu_platform():  # the switch off: sglang's own (it accepts anything)
            assert (
                _server_args(tmp_path, "sparsity=0.5,bogus=1").attention_backend_config.bogus == 1
            )
    finally:
        module._global_server_args = saved


def test_a_causal_pipeline_refuses_block_sparse_attn_at_start_up(tmp_path: Path) -> None:
    """sglang's causal (block-by-block, KV-cached) denoising builds attention metadata for
    VSA only: ditops' backend would get none and run dense. Refused when the arguments
    are built, with why; the same pipeline dense, and a non-causal one sparse, start."""
    from sglang.multimodal_gen.runtime.server_args import ServerArgs
    from sglang.multimodal_gen.runtime.server_args import server_args as module

    from tests.sglang.tiny_wan import write_tiny_causal_wan

    saved = module._global_server_args
    causal = str(write_tiny_causal_wan(tmp_path))
    sparse = dict(attention_backend="block_sparse_attn", attention_backend_config="sparsity=0.5")
    try:
        with ditops_platform():
            with pytest.raises(ValueError, match="causal.*video_sparse_attn only"):
                ServerArgs.from_kwargs(model_path=causal, num_gpus=1, **sparse)
            assert _server_args(tmp_path, "sparsity=0.5").attention_backend == "block_sparse_attn"
            dense = ServerArgs.from_kwargs(model_path=causal, num_gpus=1)
            assert dense.pipeline_config.is_causal
    finally:
        module._global_server_args = saved


def test_the_start_up_notice_names_a_platform_without_sparse_kernels(caplog) -> None:
    class MpsLike(VendorPlatform):
        device_type = "mps"

    args = types.SimpleNamespace(attention_backend="block_sparse_attn", attention_backend_config={})
    with ditops_platform(instance=MpsLike()), caplog.at_level("WARNING"):
        plugin.check_server_args(None, args)
    text = caplog.text
    assert "ditops runs" in text and "MulAdd" in text and "LayerNormScaleShift" in text
    assert "device 'mps' has no ditops kernel" in text


def test_a_ditops_failure_at_model_build_refuses_sglang_s_native_fallback() -> None:
    from sglang.multimodal_gen.runtime.loader.component_loaders.component_loader import (
        ComponentLoader,
    )

    install_hooks()
    assert ComponentLoader._load_native_with_context.__wrapped__  # the hook is in place
    native = lambda *a, **k: "diffusers' class"  # noqa: E731
    with ditops_platform():
        try:
            attention.config_from({"bogus": 1})
        except ValueError:
            with pytest.raises(RuntimeError, match="failed in ditops.*bogus.*fallback.*refused"):
                plugin.load_native_with_context(native, "path")
        try:
            raise KeyError("not ditops'")
        except KeyError:  # anything else: sglang's fallback as stock
            assert plugin.load_native_with_context(native, "path") == "diffusers' class"


def test_a_k_v_config_with_an_unknown_key_stops_start_up(tmp_path: Path) -> None:
    """The whole front door: ``DiffGenerator`` with a ``k=v`` config naming an unknown key
    exits non-zero with ditops' message, before any worker starts."""
    folder = tmp_path / "Wan2.1-T2V-1.3B-Diffusers"
    folder.mkdir()
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    out = subprocess.run(
        [sys.executable, str(HERE / "run_generator.py"), str(folder), str(tmp_path / "x.npy"),
         "block_sparse_attn", "sparsity=0.5,bogus=1"],
        env=_env("1"), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode != 0
    assert "block_sparse_attn (ditops): unknown --attention-backend-config key(s) bogus" in (
        out.stderr + out.stdout
    )


def test_text_encoders_stay_dense_under_block_sparse_attn() -> None:
    from sglang.multimodal_gen.runtime.layers.attention import selector

    sparse = AttentionBackendEnum.BLOCK_SPARSE_ATTN
    install_hooks()
    with ditops_platform():
        for component, want in (
            ("text_encoder", "SDPABackend"), ("text_encoder_2", "SDPABackend"),
            ("image_encoder", "SDPABackend"), ("transformer", "DitopsBlockSparseBackend"),
            ("transformer_2", "DitopsBlockSparseBackend"),
        ):  # fmt: skip
            with selector.component_attn_backend_context_manager(None, component):
                got = selector._cached_get_attn_backend(64, torch.float32, (), sparse)
            assert got.__name__ == want, component
