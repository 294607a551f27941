"""ditops.patch on a tiny diffusers ZImageTransformer2DModel built from keyword arguments.

Parity: exact precision is bitwise equal to the unpatched model in fp32, bf16 and fp16,
with samples of different lengths (padding masks), in Omni mode (per-token modulation of
noisy and clean tokens, the SigLIP refiner), with the fused CPU paths counted per forward
(not a silent fall back to the eager expressions, which would be trivially equal); fast
precision within tolerance; unpatch restores bitwise. Then what a patch must survive:
deep copies, pickling, patching again, hooks (torch's, diffusers' group offloading),
torch.compile, and models it must refuse.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch
from diffusers import ZImageTransformer2DModel
from diffusers.models.transformers import transformer_z_image as tz
from torch import nn

import ditops
from ditops.integrations import PatchError
from tests.integrations.family_life import (
    DTYPES,
    FamilyContract,
    HookContract,
    Life,
    changed,
    refused_whole,
    setting,
)
from tests.integrations.spies import cpu_paths_of

NAME = "ZImageTransformer2DModel"
FAST_REL_TOL = 2e-2  # bf16/fp16 activations through 4 blocks: a few ulps of the dtype
TINY = dict(
    all_patch_size=(2,),
    all_f_patch_size=(1,),
    in_channels=4,
    dim=32,
    n_layers=2,
    n_refiner_layers=1,
    n_heads=2,
    n_kv_heads=2,
    cap_feat_dim=24,
    axes_dims=[4, 6, 6],
    axes_lens=[128, 32, 32],
)


def tiny_z_image(dtype: torch.dtype = torch.bfloat16, **overrides: object) -> nn.Module:
    torch.manual_seed(0)
    model = ZImageTransformer2DModel(**{**TINY, **overrides}).to(dtype).eval()
    with torch.no_grad():  # RMSNorm weights start at 1: make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
            elif "pad_token" in name:  # diffusers < 0.41 leaves them torch.empty: as 0.42
                p.zero_()
    return model


def inputs(dtype: torch.dtype = torch.bfloat16, batch: int = 2) -> dict:
    """Images and captions of different sizes per sample (the second pads to 64 tokens,
    the first to 32): padded, masked sequences."""
    g = torch.Generator().manual_seed(1)
    return {
        "x": [torch.randn(4, 1, 8 + 4 * i, 6 + 6 * i, generator=g).to(dtype) for i in range(batch)],
        "t": torch.tensor([0.3] * batch, dtype=dtype),
        "cap_feats": [torch.randn(5 + 30 * i, 24, generator=g).to(dtype) for i in range(batch)],
    }


def omni_inputs(dtype: torch.dtype = torch.bfloat16, batch: int = 2) -> dict:
    """Omni mode: a clean reference image (with SigLIP features) and the noisy target."""
    g = torch.Generator().manual_seed(2)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    return {
        "x": [[r(4, 1, 4, 6), r(4, 1, 6, 6)] for _ in range(batch)],
        "t": torch.tensor([0.3] * batch, dtype=dtype),
        "cap_feats": [[r(3 + i, 24), r(4, 24)] for i in range(batch)],
        "siglip_feats": [[r(2, 3, 20), None] for _ in range(batch)],
        "image_noise_mask": [[0, 1]] * batch,
    }


def run(model: nn.Module, **kw: object) -> list[torch.Tensor]:
    with torch.inference_mode():
        return list(model(**kw, return_dict=False)[0])


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


ZIMAGE_OPS = ("adaln_modulate", "adaln_residual", "qk_norm_rope", "rms_norm")
cpu_paths = cpu_paths_of(*ZIMAGE_OPS)  # counts the calls reaching each op's forward_cpu


def per_forward(blocks: int) -> dict[str, int]:
    """Per block: four RMSNorms, two residuals, one prologue; the final layer's norm."""
    return {
        "rms_norm": 4 * blocks,
        "adaln_residual": 2 * blocks,
        "qk_norm_rope": blocks,
        "adaln_modulate": 1,
    }


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_omni_mode_per_token_modulation_is_bitwise(dtype: str, cpu_paths: dict) -> None:
    model = tiny_z_image(DTYPES[dtype], siglip_feat_dim=20)
    x = omni_inputs(DTYPES[dtype])
    ref = run(model, **x)
    report = ditops.patch(model, precision="exact")
    assert report.models[NAME]["fused blocks"] == 5  # with the SigLIP refiner's
    assert same(run(model, **x), ref)
    assert cpu_paths == per_forward(5)


def test_exact_off_the_cpu_runs_diffusers_processor() -> None:
    """A GPU may compute the complex product with fused multiply-adds: exact precision
    off the CPU keeps diffusers' processor (meta tensors stand for the device)."""
    model = tiny_z_image()
    ditops.patch(model, precision="exact")
    attn = model.layers[0].attention
    processor, called = attn.processor, []
    processor.original = lambda *args: called.append(args) or "original"
    h = torch.empty(1, 6, 32, device="meta", dtype=torch.bfloat16)
    freqs = torch.polar(torch.ones(1, 6, 8), torch.randn(1, 6, 8))
    assert processor(attn, h, freqs_cis=freqs) == "original"
    assert len(called) == 1


def test_exact_off_the_cpu_runs_diffusers_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off the CPU (meta tensors stand for the device) an exact block runs diffusers'
    forward: an NPU's RMSNorm is npu_rms_norm, which the rms op's meaning is not."""
    model = tiny_z_image()
    ditops.patch(model, precision="exact")
    called = []
    monkeypatch.setattr(
        tz.ZImageTransformerBlock, "forward", lambda *args: called.append(args) or "diffusers"
    )
    x = torch.empty(1, 6, 32, device="meta", dtype=torch.bfloat16)
    assert model.context_refiner[0](x, None, None) == "diffusers"
    assert len(called) == 1


def test_a_hook_on_a_q_norm_keeps_diffusers_prologue(cpu_paths: dict) -> None:
    model = tiny_z_image()
    x = inputs()
    seen: list[int] = []
    ditops.patch(model, precision="exact")
    model.noise_refiner[0].attention.norm_k.register_forward_hook(lambda *_: seen.append(1))
    assert same(run(model, **x), run(tiny_z_image(), **x))
    assert seen == [1]
    assert cpu_paths["qk_norm_rope"] == 3  # the other blocks' prologues


def test_leaf_level_group_offloading_runs_diffusers_code_bitwise() -> None:
    """diffusers' leaf-level group offloading hooks every module with weights: every
    RMSNorm (the blocks' and the q/k norms) is hooked, so blocks and prologues run
    diffusers' code, which onloads them; the final layer's norm has no weights: fused."""
    model = tiny_z_image()
    x = inputs()
    ref = run(model, **x)
    cpu = torch.device("cpu")
    model.enable_group_offload(onload_device=cpu, offload_device=cpu, offload_type="leaf_level")
    report = ditops.patch(model, precision="exact")
    assert report.models[NAME]["unfused blocks"] == 4
    assert report.models[NAME]["fused final layers"] == 1
    assert same(run(model, **x), ref)


def test_a_norm_of_another_kind_runs_diffusers_forward() -> None:
    model = tiny_z_image()
    model.context_refiner[0].attention_norm2 = nn.LayerNorm(32).bfloat16()
    x = inputs()
    ref = run(model, **x)
    report = ditops.patch(model, precision="exact")
    why = report.unfused[NAME]["context_refiner.0"]
    assert why == "attention_norm2 is a LayerNorm, not diffusers' RMSNorm with a weight and no bias"
    assert report.models[NAME]["fused blocks"] == 3
    assert same(run(model, **x), ref)


LIFE = Life(
    make=tiny_z_image,
    inputs=inputs,
    run=run,
    same=same,
    blocks="layers",
    attn="attention",
    processor=tz.ZSingleStreamAttnProcessor,
    cases=inputs,
)


def _final_norm(monkeypatch: pytest.MonkeyPatch, model: nn.Module) -> None:
    modules = model.all_final_layer["2-1"]._modules  # (setitem: undone with the rest)
    monkeypatch.setitem(modules, "norm_final", nn.LayerNorm(32).bfloat16())


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (
            changed(tz.ZImageTransformerBlock, "forward"),
            r"noise_refiner\[0\] is a ZImageTransformerBlock whose forward",
        ),
        (changed(tz.FinalLayer, "forward"), r"all_final_layer\['2-1'\] is a FinalLayer whose"),
        (changed(tz, "select_per_token"), r"select_per_token of diffusers .* differs"),
        (
            changed(tz.ZSingleStreamAttnProcessor, "__call__"),
            r"attention.processor ZSingleStreamAttnProcessor.__call__ \(",
        ),
        (
            setting("layers.1.attention.norm_k", "eps", 1e-6),
            r"layers\[1\].attention.norm_q/norm_k have different eps",
        ),
        (_final_norm, r"all_final_layer\['2-1'\].norm_final is not a LayerNorm without affine"),
    ],
    ids=["block_forward", "final_forward", "select_per_token", "processor", "qk_eps", "final"],
)
def test_models_it_was_not_written_for_are_refused_whole(
    change, fragment: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    refused_whole(LIFE, change, fragment, monkeypatch)


def test_without_qk_norms_is_refused() -> None:
    model = tiny_z_image(qk_norm=False)
    with pytest.raises(PatchError, match=r"no q/k norms \(qk_norm=False\)"):
        ditops.patch(model)
    assert not hasattr(model, "_ditops_patch")


def _rope_tables(model: nn.Module) -> None:
    # diffusers' RopeEmbedder builds its tables on the first call under a device context
    # manager, which dynamo does not trace (patched or not): built before compiling.
    model.rope_embedder(torch.zeros(1, 3, dtype=torch.long))


class TestContract(FamilyContract, HookContract):
    """A patched model's life (tests/integrations/family_life.py): sparse attention refused,
    deep copies, pickling, patching again, compile first, the Triton paths."""

    life = LIFE
    hooked = ("layers.1.ffn_norm2", 3)
    exact_cases = [(d, {}) for d in ("fp32", "bf16", "fp16")]
    fused = {"fused blocks": 4, "fused attention prologues": 4, "fused final layers": 1}
    cpu_calls = per_forward(4)
    triton_ops = ZIMAGE_OPS
    triton_tolerance = FAST_REL_TOL
    triton_calls = per_forward(3)

    def weights(self, model: nn.Module) -> list[torch.Tensor]:
        return [p for b in model.layers for p in (b.attention.norm_q.weight, b.ffn_norm1.weight)]

    def small(self) -> Life:
        return replace(LIFE, make=functools.partial(tiny_z_image, n_layers=1))

    def prepare_compile(self, model: nn.Module) -> None:
        _rope_tables(model)
