"""ditops.patch on a tiny diffusers Flux2Transformer2DModel built from keyword arguments.

Parity: exact precision is bitwise the unpatched model in fp32, bf16 and fp16 (fp16 also
runs FLUX.2's clipping), with the fused CPU paths shown to run and counted per forward;
the Klein KV pipeline's per-token modulations and kept KV processors too; fast precision
within tolerance; unpatch restores. Then what a patch must survive (deep copies,
pickling, patching again, diffusers' FirstBlockCache in both orders, a torch hook on a
bypassed norm, torch.compile) and the models it must refuse.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import replace

import pytest
import torch
from diffusers import Flux2Transformer2DModel
from diffusers.models import embeddings
from diffusers.models.transformers import transformer_flux2 as tf2
from torch import nn

import ditops
from tests.integrations.family_life import (
    FamilyContract,
    Life,
    batches,
    cached_steps,
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

#: fast precision: output against the unpatched model, relative to its scale.
FAST_REL_TOL = 2e-2
NAME = "Flux2Transformer2DModel"

TINY = dict(
    patch_size=1,
    in_channels=8,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=24,
    timestep_guidance_channels=32,
    mlp_ratio=2.0,
    axes_dims_rope=(4, 4, 4, 4),
    guidance_embeds=False,
)
TEXT = 7  # odd: the tables split at an odd row
SIDE = 5
#: diffusers 0.36's FLUX.2 always embeds a guidance (0.37 on: ``guidance_embeds``, off here)
GUIDED = "guidance_embeds" not in inspect.signature(Flux2Transformer2DModel.__init__).parameters


def tiny_flux2(dtype: torch.dtype = torch.bfloat16, **overrides: object) -> Flux2Transformer2DModel:
    torch.manual_seed(0)
    config = {**TINY, **overrides}
    if GUIDED:
        del config["guidance_embeds"]
    return Flux2Transformer2DModel(**config).to(dtype).eval()


def image_ids(side: int = SIDE, t: int = 0) -> torch.Tensor:
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    return torch.stack([torch.full_like(rows, t), rows, cols, torch.zeros_like(rows)], -1).reshape(
        -1, 4
    )


def inputs(dtype: torch.dtype = torch.bfloat16, batch: int = 1) -> dict:
    g = torch.Generator().manual_seed(1)
    txt_ids = torch.zeros(TEXT, 4, dtype=torch.long)
    txt_ids[:, 3] = torch.arange(TEXT)
    x = {
        "hidden_states": torch.randn(batch, SIDE * SIDE, 8, generator=g).to(dtype) * 2,
        "encoder_hidden_states": torch.randn(batch, TEXT, 24, generator=g).to(dtype),
        "timestep": torch.tensor([0.7, 0.3][:batch] + [0.5] * (batch - 2), dtype=dtype),
        "img_ids": image_ids(),
        "txt_ids": txt_ids,
    }
    return {**x, "guidance": torch.full((batch,), 3.5, dtype=dtype)} if GUIDED else x


run = first_output


cpu_paths = cpu_paths_of(*FLUX_OPS)  # counts the calls reaching each op's forward_cpu

PER_FORWARD, FUSED = FLUX_PER_FORWARD, FLUX_FUSED  # 2 double, 2 single blocks, as FLUX


def test_fused_projections_and_guidance(cpu_paths: dict[str, int]) -> None:
    """``fuse_qkv_projections`` (to_qkv / to_added_qkv, diffusers' own split) and the
    guidance embedding of the guidance-distilled FLUX.2 [dev]."""
    model = tiny_flux2(guidance_embeds=True)
    model.fuse_qkv_projections()
    x = {**inputs(batch=2), "guidance": torch.tensor([3.5, 3.5], dtype=torch.bfloat16)}
    ref = run(model, **x)
    assert ditops.patch(model, precision="exact").models[NAME] == FUSED
    assert torch.equal(run(model, **x), ref)
    assert cpu_paths == PER_FORWARD


def _kv_runs(model: nn.Module, x: dict) -> list[torch.Tensor]:
    """The Klein KV pipeline's two modes: a first step extracting the reference tokens'
    K/V (per-token modulations blended for them), then one attending to the cache."""
    ref_tokens = torch.randn(1, 9, 8, generator=torch.Generator().manual_seed(2)).bfloat16()
    extract = {
        **x,
        "hidden_states": torch.cat([ref_tokens, x["hidden_states"]], dim=1),
        "img_ids": torch.cat([image_ids(3, t=10), x["img_ids"]]),
    }
    with torch.inference_mode():
        first, cache = model(
            **extract, kv_cache_mode="extract", num_ref_tokens=9, return_dict=False
        )
        then = model(**x, kv_cache=cache, kv_cache_mode="cached", return_dict=False)[0]
    return [first, then]


def test_kv_cache_processors_are_kept_and_per_token_modulations_fused(
    cpu_paths: dict[str, int],
) -> None:
    model = tiny_flux2()
    for block in model.transformer_blocks:
        block.attn.set_processor(tf2.Flux2KVAttnProcessor())
    for block in model.single_transformer_blocks:
        block.attn.set_processor(tf2.Flux2KVParallelSelfAttnProcessor())
    x = inputs()
    want = _kv_runs(model, x)
    report = ditops.patch(model, precision="exact")
    assert report.models[NAME] == {
        "fused blocks": 4,
        "fused output norm": 1,
        "attention processors kept": 4,
    }
    got = _kv_runs(model, x)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert cpu_paths["adaln_residual_modulate"] == 2 * 2 * 2  # both calls ran fused
    assert "qk_norm_rope" not in cpu_paths


def test_modulations_handed_split_as_diffusers_0_36_hands_them(cpu_paths: dict) -> None:
    """diffusers 0.36's model splits the modulations itself and hands the blocks the chunks
    (``temb_mod_params_img``/``_txt``, ``temb_mod_params``): the fused blocks given them so
    compute what they compute from the one tensor of 0.37 on, bitwise."""
    from diffusers.models.transformers.transformer_flux2 import Flux2Modulation

    model = tiny_flux2()
    ditops.patch(model, precision="exact")
    double, single = model.transformer_blocks[0], model.single_transformer_blocks[0]
    g = torch.Generator().manual_seed(3)
    h, c = (torch.randn(2, n, 32, generator=g).bfloat16() for n in (9, 5))
    m_img, m_txt, m_one = (torch.randn(2, k * 96, generator=g).bfloat16() for k in (2, 2, 1))
    with torch.inference_mode():
        want = double(h, c, m_img, m_txt)
        got = double(
            hidden_states=h,
            encoder_hidden_states=c,
            temb_mod_params_img=Flux2Modulation.split(m_img, 2),
            temb_mod_params_txt=Flux2Modulation.split(m_txt, 2),
        )
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        split = Flux2Modulation.split(m_one, 1)[0]
        assert torch.equal(single(h, None, temb_mod_params=split), single(h, None, m_one))
    assert cpu_paths["adaln_residual_modulate"] == 4  # fused both ways, not diffusers' code


def test_tables_in_another_dtype() -> None:
    """bf16 tables rotate in fp32 in apply_rotary_emb (so in the op, widened); fp64 tables
    rotate in fp64 there: the processor runs diffusers' code for them."""
    model = tiny_flux2()
    ditops.patch(model, precision="exact")
    attn = model.single_transformer_blocks[0].attn
    h = torch.randn(1, 9, 32, dtype=torch.bfloat16)
    ids = torch.arange(36).reshape(9, 4) % 5
    processor = attn.processor
    for dtype in (torch.bfloat16, torch.float64):
        cos, sin = (t.to(dtype) for t in model.pos_embed(ids))
        with torch.inference_mode():
            got = processor(attn, h, image_rotary_emb=(cos, sin))
            want = processor.original(attn, h, image_rotary_emb=(cos, sin))
        assert torch.equal(got, want)


def test_a_processor_built_by_a_loader_runs_the_original_code() -> None:
    model = tiny_flux2()
    ditops.patch(model, precision="exact")
    for attn in (model.transformer_blocks[0].attn, model.single_transformer_blocks[0].attn):
        built = type(attn.processor)()
        assert built.ops is None
        assert type(built.original).__name__ == built.wraps[1]


def test_a_block_with_a_norm_of_another_kind_runs_diffusers_forward() -> None:
    model = tiny_flux2()
    model.transformer_blocks[1].norm2_context = nn.LayerNorm(32).bfloat16()
    nn.init.normal_(model.transformer_blocks[1].norm2_context.weight)
    x = inputs()
    ref = run(model, **x)
    report = ditops.patch(model, precision="exact")
    why = report.unfused[NAME]["transformer_blocks.1"]
    assert "norm2_context is a LayerNorm, not a LayerNorm without affine" in why
    assert report.models[NAME]["fused blocks"] == 3
    assert "forward" not in vars(model.transformer_blocks[1])
    assert torch.equal(run(model, **x), ref)


def test_a_hook_on_a_bypassed_norm_runs_the_block_unfused(cpu_paths: dict[str, int]) -> None:
    model = tiny_flux2()
    x = inputs()
    ref = run(model, **x)
    ditops.patch(model, precision="exact")
    seen = []
    handle = model.single_transformer_blocks[1].norm.register_forward_hook(
        lambda m, a, out: seen.append(out.shape)
    )
    assert torch.equal(run(model, **x), ref)
    assert seen == [torch.Size([1, TEXT + SIDE * SIDE, 32])]  # the hook saw its call
    assert cpu_paths["adaln_modulate"] == PER_FORWARD["adaln_modulate"] - 1
    handle.remove()
    assert torch.equal(run(model, **x), ref)
    assert cpu_paths["adaln_modulate"] == 2 * PER_FORWARD["adaln_modulate"] - 1


LIFE = Life(
    make=tiny_flux2,
    inputs=lambda: inputs(batch=2),
    processor=tf2.Flux2AttnProcessor,
    cases=inputs,
)


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (
            changed(tf2.Flux2TransformerBlock, "forward"),
            r"transformer_blocks\[0\] is a Flux2Transformer",
        ),
        (
            changed(tf2.Flux2SingleTransformerBlock, "forward"),
            r"single_transformer_blocks\[1\] is a",
        ),
        (
            changed(tf2.Flux2ParallelSelfAttnProcessor, "__call__"),
            r"processor .*differs from the versions",
        ),
        (changed(embeddings, "apply_rotary_emb"), r"apply_rotary_emb of diffusers .* differs"),
        (
            setting("transformer_blocks.1.attn.norm_added_k", "eps", 1e-3),
            r"transformer_blocks\[1\].attn.norm_added_q and norm_added_k have different eps",
        ),
    ],
    ids=["double_block", "single_block", "processor", "rotary", "qk_eps"],
)
def test_models_it_was_not_written_for_are_refused_whole(
    change, fragment: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    refused_whole(LIFE, change, fragment, monkeypatch)


def test_norms_false_changes_nothing() -> None:
    model = tiny_flux2()
    report = ditops.patch(model, norms=False)
    assert report.models[NAME] == {}
    assert "forward" not in vars(model.transformer_blocks[0])


#: Four steps' timesteps (TaylorSeer caches some of them).
STEPS = [torch.tensor([0.9 - 0.1 * i], dtype=torch.bfloat16) for i in range(4)]


def test_diffusers_cache_hooks_in_both_orders(cpu_paths: dict[str, int]) -> None:
    """TaylorSeer (hooks on the attention modules: cached steps skip them) before and after
    the patch. (diffusers 0.42.1's FirstBlockCache fails on an unpatched FLUX.2: its tail
    single-stream block returns one tensor where the head block returned two.)"""
    from diffusers import TaylorSeerCacheConfig

    x = inputs()
    cache = TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1)
    plain = tiny_flux2()
    plain.enable_cache(cache)
    want = cached_steps(plain, x, STEPS)
    for patch_first in (True, False):
        model = tiny_flux2()
        if patch_first:
            ditops.patch(model, precision="exact")
        model.enable_cache(cache)
        if not patch_first:
            ditops.patch(model, precision="exact")
        assert all(torch.equal(a, b) for a, b in zip(cached_steps(model, x, STEPS), want))
    assert cpu_paths["adaln_residual_modulate"] == 2 * 4 * PER_FORWARD["adaln_residual_modulate"]
    assert 0 < cpu_paths["qk_norm_rope"] < 2 * 4 * PER_FORWARD["qk_norm_rope"]  # some cached


@pytest.mark.parametrize("patch_first", [True, False], ids=["patch_first", "hook_first"])
def test_block_level_group_offloading_in_both_orders(
    patch_first: bool, cpu_paths: dict[str, int]
) -> None:
    """diffusers hooks on the blocks themselves: the fused forward runs under them."""
    x = inputs()
    want = run(tiny_flux2(), **x)
    model = tiny_flux2()
    if patch_first:
        ditops.patch(model, precision="exact")
    model.enable_group_offload(
        torch.device("cpu"), offload_type="block_level", num_blocks_per_group=1
    )
    if not patch_first:
        assert ditops.patch(model, precision="exact").models[NAME] == FUSED
    assert torch.equal(run(model, **x), want)
    assert cpu_paths == PER_FORWARD
    ditops.unpatch(model)
    assert torch.equal(run(model, **x), want)


class TestContract(FamilyContract):
    """A patched model's life (tests/integrations/family_life.py): sparse attention refused,
    deep copies, pickling, patching again, compile first and the Triton paths (one block
    of each kind)."""

    life = LIFE
    exact_cases = batches(("fp32", 1), ("bf16", 1), ("bf16", 2), ("fp16", 2))
    fused = FUSED
    cpu_calls = PER_FORWARD
    fast_case = {"batch": 2}
    triton_ops = FLUX_OPS
    triton_tolerance = FAST_REL_TOL
    triton_calls = FLUX_ONE_OF_EACH

    def weights(self, model: nn.Module) -> list[torch.Tensor]:
        return [block.attn.norm_q.weight for block in model.single_transformer_blocks]

    def small(self) -> Life:
        return replace(LIFE, make=functools.partial(tiny_flux2, num_layers=1, num_single_layers=1))
