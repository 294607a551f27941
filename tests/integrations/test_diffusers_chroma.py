"""ditops.patch on a tiny diffusers ChromaTransformer2DModel built from keyword arguments.

Parity: exact precision is bitwise equal to the unpatched model in fp32, bf16 and fp16
(fp16 also exercises the clipping), with and without Chroma's text mask, the fused CPU
paths shown to run and counted per forward; fast precision within tolerance; unpatch
restores. Then what a patch must survive: deep copies, pickling, patching again,
diffusers' layerwise casting, hooks on bypassed norms, torch.compile, and models it
must refuse.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch
from diffusers import ChromaTransformer2DModel
from diffusers.models.transformers import transformer_chroma as tc
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor
from torch import nn

import ditops
from tests.integrations.family_life import (
    FamilyContract,
    Life,
    OffloadContract,
    changed,
    first_output,
    refused_whole,
    setting,
)
from tests.integrations.spies import (
    FLUX_FUSED,
    FLUX_ONE_OF_EACH,
    FLUX_OPS,
    FLUX_PER_FORWARD,
    cpu_paths_of,
)

FAST_REL_TOL = 2e-2  # as FLUX's

TINY = dict(
    patch_size=1,
    in_channels=6,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=20,
    axes_dims_rope=(4, 6, 6),
    approximator_num_channels=16,
    approximator_hidden_dim=24,
    approximator_layers=2,
)
TEXT, SIDE = 5, 4


def tiny_chroma(dtype: torch.dtype = torch.bfloat16, **overrides: object) -> nn.Module:
    torch.manual_seed(0)
    return ChromaTransformer2DModel(**{**TINY, **overrides}).to(dtype).eval()


def inputs(dtype: torch.dtype = torch.bfloat16, batch: int = 1, mask: bool = False) -> dict:
    """Chroma's call; ``mask``: the pipeline's ``[B, text + image]`` mask, the second
    sample's last text tokens padded."""
    g = torch.Generator().manual_seed(1)
    rows, cols = torch.meshgrid(torch.arange(SIDE), torch.arange(SIDE), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3).float()
    x = {
        "hidden_states": torch.randn(batch, SIDE * SIDE, 6, generator=g).to(dtype) * 2,
        "encoder_hidden_states": torch.randn(batch, TEXT, 20, generator=g).to(dtype),
        "timestep": torch.tensor([0.8, 0.25][:batch], dtype=dtype),
        "img_ids": img_ids,
        "txt_ids": torch.zeros(TEXT, 3),
    }
    if mask:
        m = torch.ones(batch, TEXT + SIDE * SIDE, dtype=torch.bool)
        m[-1, TEXT - 2 : TEXT] = False
        x["attention_mask"] = m
    return x


run = first_output


cpu_paths = cpu_paths_of(*FLUX_OPS)


def test_hooks_on_bypassed_norms_run_diffusers_forward_bitwise() -> None:
    """A torch hook on a single block's norm and on the output norm's LayerNorm: those
    run diffusers' forward (the hooks see their calls), the rest stays fused; bitwise."""
    model = tiny_chroma()
    x = inputs(batch=2, mask=True)
    ref = run(model, **x)
    ditops.patch(model, precision="exact")
    seen: list[str] = []
    model.single_transformer_blocks[1].norm.register_forward_hook(lambda *a: seen.append("s"))
    model.norm_out.norm.register_forward_hook(lambda *a: seen.append("out"))
    assert torch.equal(run(model, **x), ref)
    assert seen == ["s", "out"]


def test_layerwise_casting_hooks_in_both_orders() -> None:
    """diffusers' layerwise casting (fp8 storage, bf16 compute: diffusers hooks on every
    layer but the norms, which it skips), before and after the patch: the blocks stay
    fused and the output is the unpatched model's, bitwise."""
    x = inputs(batch=2, mask=True)
    casting = dict(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    plain = tiny_chroma()
    plain.enable_layerwise_casting(**casting)
    want = run(plain, **x)
    patch_first = tiny_chroma()
    ditops.patch(patch_first, precision="exact")
    patch_first.enable_layerwise_casting(**casting)
    assert torch.equal(run(patch_first, **x), want)
    hook_first = tiny_chroma()
    hook_first.enable_layerwise_casting(**casting)
    report = ditops.patch(hook_first, precision="exact")
    assert report.models["ChromaTransformer2DModel"]["fused blocks"] == 4
    assert torch.equal(run(hook_first, **x), want)


def test_a_block_with_a_norm_of_another_kind_runs_diffusers_forward() -> None:
    model = tiny_chroma()
    model.transformer_blocks[1].norm2_context = nn.LayerNorm(32).bfloat16()
    nn.init.normal_(model.transformer_blocks[1].norm2_context.weight)
    x = inputs()
    ref = run(model, **x)
    report = ditops.patch(model, precision="exact")
    why = report.unfused["ChromaTransformer2DModel"]["transformer_blocks.1"]
    assert "norm2_context is a LayerNorm, not a LayerNorm without affine" in why
    assert report.models["ChromaTransformer2DModel"]["fused blocks"] == 3
    assert torch.equal(run(model, **x), ref)


LIFE = Life(
    make=tiny_chroma,
    inputs=lambda: inputs(batch=2, mask=True),
    processor=FluxAttnProcessor,
    cases=inputs,
)


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (
            changed(tc.ChromaSingleTransformerBlock, "forward"),
            r"single_transformer_blocks\[0\] is a ChromaSingleTransformerBlock whose",
        ),
        (
            changed(tc.ChromaAdaLayerNormZeroPruned, "forward"),
            r"ChromaAdaLayerNormZeroPruned.forward of diffusers .* differs",
        ),
        (
            setting("transformer_blocks.1.attn.norm_k", "eps", 1e-5),
            r"transformer_blocks\[1\].attn.norm_q and norm_k have different eps",
        ),
    ],
    ids=["block", "norm", "qk_eps"],
)
def test_refused_whole_changing_nothing(
    change, fragment: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    refused_whole(LIFE, change, fragment, monkeypatch)


class TestContract(FamilyContract, OffloadContract):
    """A patched model's life (tests/integrations/family_life.py): sparse attention refused,
    deep copies, pickling, patching again, compile first, the Triton paths (with the text
    mask), offload in both orders."""

    life = LIFE
    exact_cases = [
        (d, {"batch": b, "mask": m})
        for d, b, m in (
            ("fp32", 1, False),
            ("bf16", 1, False),
            ("bf16", 2, True),
            ("fp16", 2, True),
        )
    ]
    fused = FLUX_FUSED
    cpu_calls = FLUX_PER_FORWARD
    fast_case = {"batch": 2, "mask": True}
    triton_ops = FLUX_OPS
    triton_tolerance = FAST_REL_TOL
    triton_calls = FLUX_ONE_OF_EACH

    def weights(self, model: nn.Module) -> list[torch.Tensor]:
        return [block.attn.norm_q.weight for block in model.transformer_blocks]

    def small(self) -> Life:
        return replace(LIFE, make=functools.partial(tiny_chroma, num_layers=1, num_single_layers=1))

    def offloaded(self, places: dict[str, str], mode: str) -> None:
        """Every block stays fused (the pruned norms and the LayerNorms they bypass hold
        no parameters)."""
        blocks = [v for k, v in places.items() if "blocks." in k or k == "norm_out"]
        assert len(blocks) == 5 and set(blocks) == {"fused"}, places
