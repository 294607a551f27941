"""ditops.patch on a tiny diffusers FluxTransformer2DModel built from keyword arguments.

Parity: exact precision is bitwise equal to the unpatched model in fp32, bf16 and fp16
(fp16 also exercises FLUX's clipping), with the fused CPU paths shown to run (not a
silent fall back to the eager expressions, which would be trivially equal); fast
precision is within the stated tolerance; unpatch restores bitwise. Then what a patch
must survive: deep copies, pickling, patching again, diffusers' cache hooks in both
orders, torch.compile before any eager call, and models it must refuse.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch
from diffusers import FluxTransformer2DModel
from diffusers.models import embeddings
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor
from torch import nn

import ditops
from tests.integrations.family_life import (
    FamilyContract,
    Life,
    batches,
    changed,
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

# fast precision: the patched model's output against the unpatched one, relative to the
# output's scale (bf16/fp16 activations through 4 blocks: a few ulps of the dtype).
FAST_REL_TOL = 2e-2

TINY = dict(
    patch_size=1,
    in_channels=8,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=24,
    pooled_projection_dim=12,
    guidance_embeds=False,
    axes_dims_rope=(4, 6, 6),
)
TEXT = 7  # an odd number of text tokens: the tables split at an odd row


def tiny_flux(dtype: torch.dtype = torch.bfloat16, **overrides: object) -> FluxTransformer2DModel:
    torch.manual_seed(0)
    return FluxTransformer2DModel(**{**TINY, **overrides}).to(dtype).eval()


def inputs(dtype: torch.dtype = torch.bfloat16, batch: int = 1, side: int = 6) -> dict:
    g = torch.Generator().manual_seed(1)
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3).float()
    return {
        "hidden_states": torch.randn(batch, side * side, 8, generator=g).to(dtype) * 2,
        "encoder_hidden_states": torch.randn(batch, TEXT, 24, generator=g).to(dtype),
        "pooled_projections": torch.randn(batch, 12, generator=g).to(dtype),
        "timestep": torch.tensor([0.7] * batch, dtype=dtype),
        "img_ids": img_ids,
        "txt_ids": torch.zeros(TEXT, 3),
    }


def run(model: nn.Module, step: int | None = None, **kw: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        if step is None:
            return model(**kw, return_dict=False)[0]
        with model.cache_context("cond", step_index=step):
            return model(**kw, return_dict=False)[0]


cpu_paths = cpu_paths_of(*FLUX_OPS)  # counts the calls reaching each op's forward_cpu


def test_guidance_and_tables_given_in_another_dtype() -> None:
    """FLUX.1-dev's guidance embedding; rotary tables that arrive as bf16 still rotate in
    fp32 as diffusers' apply_rotary_emb does."""
    model = tiny_flux(torch.bfloat16, guidance_embeds=True)
    x = {**inputs(), "guidance": torch.tensor([3.5], dtype=torch.bfloat16)}
    ref = run(model, **x)
    ditops.patch(model, precision="exact")
    assert torch.equal(run(model, **x), ref)
    attn = model.single_transformer_blocks[0].attn
    h = torch.randn(1, 9, 32, dtype=torch.bfloat16)
    cos, sin = (t.bfloat16() for t in model.pos_embed(torch.zeros(9, 3) + 1.5))
    processor = attn.processor
    with torch.inference_mode():
        got = processor(attn, h, image_rotary_emb=(cos, sin))
        want = processor.original(attn, h, image_rotary_emb=(cos, sin))
    assert torch.equal(got, want)


def test_other_processors_are_kept_and_the_blocks_still_fused() -> None:
    class MyProcessor(FluxAttnProcessor):
        pass

    model = tiny_flux()
    x = inputs()
    mine = MyProcessor()
    model.single_transformer_blocks[1].attn.set_processor(mine)
    ref = run(model, **x)
    report = ditops.patch(model, precision="exact")
    summary = report.models["FluxTransformer2DModel"]
    assert summary["fused attention prologues"] == 3
    assert summary["attention processors kept"] == 1
    assert model.single_transformer_blocks[1].attn.processor is mine
    assert torch.equal(run(model, **x), ref)


def _affine_norm2(model: nn.Module) -> None:
    model.transformer_blocks[1].norm2 = nn.LayerNorm(32, elementwise_affine=True).bfloat16()


def test_a_block_with_a_norm_of_another_kind_runs_diffusers_forward() -> None:
    model = tiny_flux()
    _affine_norm2(model)
    nn.init.normal_(model.transformer_blocks[1].norm2.weight)
    x = inputs()
    ref = run(model, **x)
    report = ditops.patch(model, precision="exact")
    why = report.unfused["FluxTransformer2DModel"]["transformer_blocks.1"]
    assert "norm2 is a LayerNorm, not a LayerNorm without affine" in why
    assert report.models["FluxTransformer2DModel"]["fused blocks"] == 3
    assert "forward" not in vars(model.transformer_blocks[1])
    assert torch.equal(run(model, **x), ref)


LIFE = Life(
    make=tiny_flux,
    inputs=lambda: inputs(batch=2),
    run=run,
    processor=FluxAttnProcessor,
    cases=inputs,
)


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (
            setting("single_transformer_blocks.0.attn.norm_k", "eps", 1e-5),
            r"single_transformer_blocks\[0\].attn.norm_q and norm_k have different eps",
        ),
        # another diffusers: its apply_rotary_emb differs (its source: the fingerprint)
        (changed(embeddings, "apply_rotary_emb"), r"apply_rotary_emb of diffusers .* differs"),
    ],
    ids=["qk_eps", "another_diffusers_version"],
)
def test_models_it_was_not_written_for_are_refused_whole(
    change, fragment: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    refused_whole(LIFE, change, fragment, monkeypatch)


def test_norms_false_changes_nothing_but_records_the_patch() -> None:
    model = tiny_flux()
    report = ditops.patch(model, norms=False)
    assert report.models["FluxTransformer2DModel"] == {}
    assert "forward" not in vars(model.transformer_blocks[0])


def _fbc_run(model: nn.Module, x: dict, steps: int = 3) -> list[torch.Tensor]:
    model._diffusers_hook.reset_stateful_hooks()
    outs = []
    with torch.inference_mode():
        for i in range(steps):
            with model.cache_context("cond", step_index=i):
                t = torch.tensor([0.9 - 0.01 * i], dtype=torch.bfloat16)
                outs.append(model(**{**x, "timestep": t}, return_dict=False)[0])
    return outs


def test_first_block_cache_in_both_orders() -> None:
    from diffusers import FirstBlockCacheConfig

    x = inputs()
    cache = FirstBlockCacheConfig(threshold=0.2)
    plain = tiny_flux()
    plain.enable_cache(cache)
    want = _fbc_run(plain, x)

    patch_first = tiny_flux()
    ditops.patch(patch_first, precision="exact")
    patch_first.enable_cache(cache)
    assert all(torch.equal(a, b) for a, b in zip(_fbc_run(patch_first, x), want))

    hook_first = tiny_flux()
    hook_first.enable_cache(cache)
    ditops.patch(hook_first, precision="exact")
    assert all(torch.equal(a, b) for a, b in zip(_fbc_run(hook_first, x), want))
    ditops.unpatch(hook_first)
    assert all(torch.equal(a, b) for a, b in zip(_fbc_run(hook_first, x), want))
    hook_first.disable_cache()
    for block in hook_first.transformer_blocks:
        assert getattr(block.forward, "__func__", None) is type(block).forward


class TestContract(FamilyContract):
    """A patched model's life (tests/integrations/family_life.py): sparse attention refused,
    deep copies, pickling, patching again, compile first and the Triton paths with one
    block of each kind (attention itself runs diffusers' SDPA). (diffusers'
    ``compile_repeated_blocks`` recompiles FLUX's single-stream block once whether patched
    or not: its second call gets a slice of the first's output, another stride.)"""

    life = LIFE
    exact_cases = batches(("fp32", 1), ("bf16", 1), ("bf16", 2), ("fp16", 2))
    fused = FLUX_FUSED
    cpu_calls = FLUX_PER_FORWARD
    fast_case = {"batch": 2}
    triton_ops = FLUX_OPS
    triton_tolerance = FAST_REL_TOL
    triton_calls = FLUX_ONE_OF_EACH

    def weights(self, model: nn.Module) -> list[torch.Tensor]:
        blocks = model.transformer_blocks
        return [w for b in blocks for w in (b.ff.net[0].proj.weight, b.attn.norm_q.weight)]

    def small(self) -> Life:
        return replace(LIFE, make=functools.partial(tiny_flux, num_layers=1, num_single_layers=1))
