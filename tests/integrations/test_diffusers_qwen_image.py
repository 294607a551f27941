"""ditops.patch on a tiny diffusers QwenImageTransformer2DModel built from keyword arguments.

Parity: exact precision is bitwise equal to the unpatched model in fp32, bf16 and fp16
(fp16 also exercises Qwen-Image's clipping), with a padded text mask, with the per-token
modulation of ``zero_cond_t`` (the edit models), with the fused CPU paths counted per
forward (not a silent fall back to the eager expressions, which would be trivially
equal); fast precision within tolerance; unpatch restores bitwise. Then what a patch must
survive: deep copies, pickling, patching again, hooks, FirstBlockCache, torch.compile,
and models it must refuse.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import replace

import pytest
import torch
from diffusers import QwenImageTransformer2DModel
from diffusers.models.transformers import transformer_qwenimage as tq
from torch import nn

import ditops
from tests.integrations.family_life import (
    DTYPES,
    FamilyContract,
    HookContract,
    Life,
    batches,
    changed,
    refused_whole,
    setting,
)
from tests.integrations.spies import FLUX_OPS, cpu_paths_of

NAME = "QwenImageTransformer2DModel"
FAST_REL_TOL = 2e-2  # bf16/fp16 activations through 2 blocks: a few ulps of the dtype
TINY = dict(
    patch_size=2,
    in_channels=12,
    out_channels=3,
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=24,
    axes_dims_rope=(4, 6, 6),
)
TEXT = 7  # an odd number of text tokens
#: diffusers before 0.37 sizes the text's rotary table by ``txt_seq_lens`` (since: the text)
TXT_SEQ_LENS = "max_txt_seq_len" not in inspect.signature(tq.QwenEmbedRope.forward).parameters


def tiny_qwen(dtype: torch.dtype = torch.bfloat16, **overrides: object) -> nn.Module:
    torch.manual_seed(0)
    model = QwenImageTransformer2DModel(**{**TINY, **overrides}).to(dtype).eval()
    with torch.no_grad():  # RMSNorm weights start at 1: make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
    return model


def inputs(
    dtype: torch.dtype = torch.bfloat16,
    batch: int = 1,
    shapes: tuple = ((1, 5, 6),),
    text: int = TEXT,
) -> dict:
    """A padded text mask on the first sample; ``shapes``: the images of each sample (more
    than one: an edit model's reference images)."""
    g = torch.Generator().manual_seed(1)
    tokens = sum(f * h * w for f, h, w in shapes)
    mask = torch.ones(batch, text, dtype=torch.long)
    mask[0, -2:] = 0
    x = {
        "hidden_states": torch.randn(batch, tokens, 12, generator=g).to(dtype) * 2,
        "encoder_hidden_states": torch.randn(batch, text, 24, generator=g).to(dtype),
        "encoder_hidden_states_mask": mask,
        "timestep": torch.tensor([0.7] * batch, dtype=dtype),
        "img_shapes": [list(shapes)] * batch,
    }
    return {**x, "txt_seq_lens": [text] * batch} if TXT_SEQ_LENS else x


def run(model: nn.Module, **kw: object) -> torch.Tensor:
    with torch.inference_mode():
        return model(**kw, return_dict=False)[0]


cpu_paths = cpu_paths_of(*FLUX_OPS)  # counts the calls reaching each op's forward_cpu
#: Per forward of the 2-block model: per block two first modulated norms, two
#: residual+norm, two last residuals, two prologues (image, text); the output norm.
PER_FORWARD = {
    "adaln_modulate": 2 * 2 + 1,
    "adaln_residual_modulate": 2 * 2,
    "adaln_residual": 2 * 2,
    "qk_norm_rope": 2 * 2,
}


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_zero_cond_t_per_token_modulation_is_bitwise(dtype: str, cpu_paths: dict) -> None:
    """The edit models: ``zero_cond_t`` (a second, zero timestep; the reference image's
    tokens modulated by it, picked per token)."""
    model = tiny_qwen(DTYPES[dtype], zero_cond_t=True)
    x = inputs(DTYPES[dtype], 2, ((1, 4, 4), (1, 2, 3)))
    ref = run(model, **x)
    ditops.patch(model, precision="exact")
    assert torch.equal(run(model, **x), ref)
    assert cpu_paths == PER_FORWARD


def test_layered_model_without_a_text_mask(cpu_paths: dict) -> None:
    """Qwen-Image-Layered: layer-3D rotary tables (the layers, then the condition image)
    and the additional timestep condition; no text mask."""
    model = tiny_qwen(use_layer3d_rope=True, use_additional_t_cond=True)
    x = inputs(batch=2, shapes=((1, 4, 4), (1, 4, 4), (1, 2, 3)))
    x = {**x, "encoder_hidden_states_mask": None, "additional_t_cond": torch.tensor([0, 1])}
    ref = run(model, **x)
    ditops.patch(model, precision="exact")
    assert torch.equal(run(model, **x), ref)
    assert cpu_paths == PER_FORWARD


def test_exact_off_the_cpu_runs_diffusers_processor() -> None:
    """A GPU may compute the complex product with fused multiply-adds: exact precision
    off the CPU keeps diffusers' processor (meta tensors stand for the device)."""
    model = tiny_qwen()
    ditops.patch(model, precision="exact")
    attn = model.transformer_blocks[0].attn
    processor, called = attn.processor, []
    processor.original = lambda *args: called.append(args) or "original"
    h = torch.empty(1, 6, 32, device="meta", dtype=torch.bfloat16)
    c = torch.empty(1, TEXT, 32, device="meta", dtype=torch.bfloat16)
    tables = model.pos_embed([(1, 2, 3)], max_txt_seq_len=TEXT, device=torch.device("cpu"))
    assert processor(attn, h, c, image_rotary_emb=tables) == "original"
    assert len(called) == 1


def test_a_hook_on_a_q_norm_keeps_diffusers_prologue(cpu_paths: dict) -> None:
    model = tiny_qwen()
    x = inputs()
    seen: list[int] = []
    ditops.patch(model, precision="exact")
    model.transformer_blocks[0].attn.norm_added_k.register_forward_hook(lambda *_: seen.append(1))
    plain = tiny_qwen()
    assert torch.equal(run(model, **x), run(plain, **x))
    assert seen == [1]
    assert cpu_paths["qk_norm_rope"] == 2  # the other block's prologue only


def test_leaf_level_group_offloading_before_the_patch(cpu_paths: dict) -> None:
    """diffusers' leaf-level group offloading hooks every module with weights: the q/k
    norms' hooks keep diffusers' prologue (the fused one would read the weights without
    onloading them); the blocks' norms have no weights, no hooks: they fuse."""
    model = tiny_qwen()
    x = inputs(batch=2)
    ref = run(model, **x)
    cpu = torch.device("cpu")
    model.enable_group_offload(onload_device=cpu, offload_device=cpu, offload_type="leaf_level")
    report = ditops.patch(model, precision="exact")
    assert report.models[NAME]["fused blocks"] == 2
    assert torch.equal(run(model, **x), ref)
    assert "qk_norm_rope" not in cpu_paths and cpu_paths["adaln_residual_modulate"] == 4


def test_a_norm_of_another_kind_runs_diffusers_forward() -> None:
    model = tiny_qwen()
    model.transformer_blocks[0].img_norm2 = nn.LayerNorm(32, eps=1e-6).bfloat16()
    nn.init.normal_(model.transformer_blocks[0].img_norm2.weight)
    x = inputs()
    ref = run(model, **x)
    report = ditops.patch(model, precision="exact")
    why = report.unfused[NAME]["transformer_blocks.0"]
    assert why == "img_norm2 is a LayerNorm, not a LayerNorm without affine parameters"
    assert report.models[NAME]["fused blocks"] == 1
    assert torch.equal(run(model, **x), ref)


def test_other_processors_are_kept_and_the_blocks_still_fused() -> None:
    class MyProcessor(tq.QwenDoubleStreamAttnProcessor2_0):
        pass

    model = tiny_qwen()
    mine = MyProcessor()
    model.transformer_blocks[1].attn.set_processor(mine)
    x = inputs()
    ref = run(model, **x)
    summary = ditops.patch(model, precision="exact").models[NAME]
    assert summary["fused attention prologues"] == 1
    assert summary["attention processors kept"] == 1 and summary["fused blocks"] == 2
    assert model.transformer_blocks[1].attn.processor is mine
    assert torch.equal(run(model, **x), ref)


LIFE = Life(
    make=tiny_qwen,
    inputs=lambda: inputs(batch=2),
    run=run,
    same=torch.equal,
    processor=tq.QwenDoubleStreamAttnProcessor2_0,
    cases=inputs,
)


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (
            changed(tq.QwenImageTransformerBlock, "forward"),
            r"transformer_blocks\[0\] is a QwenImageTransformerBlock whose",
        ),
        (
            changed(tq.QwenImageTransformerBlock, "_modulate"),
            r"QwenImageTransformerBlock._modulate of diffusers .* differs",
        ),
        (changed(tq, "apply_rotary_emb_qwen"), r"apply_rotary_emb_qwen of diffusers .* differs"),
        (
            changed(tq.QwenDoubleStreamAttnProcessor2_0, "__call__"),
            r"attn.processor QwenDoubleStreamAttnProcessor2_0.__call__ \(",
        ),
        (
            setting("transformer_blocks.1.attn.norm_added_k", "eps", 1e-5),
            r"transformer_blocks\[1\].attn.norm_added_q/norm_added_k have different eps",
        ),
    ],
    ids=["block_forward", "modulate", "rotary", "processor", "qk_eps"],
)
def test_models_it_was_not_written_for_are_refused_whole(
    change, fragment: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    refused_whole(LIFE, change, fragment, monkeypatch)


class TestContract(FamilyContract, HookContract):
    """A patched model's life (tests/integrations/family_life.py): sparse attention refused,
    deep copies, pickling, patching again, compile first, the Triton paths."""

    life = LIFE
    hooked = ("transformer_blocks.1.txt_norm2", 1)
    exact_cases = batches(("fp32", 1), ("bf16", 2), ("fp16", 2))
    fused = {"fused blocks": 2, "fused attention prologues": 2, "fused output norm": 1}
    cpu_calls = PER_FORWARD
    fast_case = {"batch": 2}
    fast_fp32_is_exact = True
    triton_ops = FLUX_OPS
    triton_tolerance = FAST_REL_TOL
    triton_calls = {
        "adaln_modulate": 3,
        "adaln_residual_modulate": 2,
        "adaln_residual": 2,
        "qk_norm_rope": 2,
    }

    def weights(self, model: nn.Module) -> list[torch.Tensor]:
        blocks = model.transformer_blocks
        return [w for b in blocks for w in (b.attn.norm_q.weight, b.txt_mod[1].weight)]

    def small(self) -> Life:
        return replace(LIFE, make=functools.partial(tiny_qwen, num_layers=1))


def _fbc_run(model: nn.Module, x: dict, steps: int = 3) -> list[torch.Tensor]:
    model._diffusers_hook.reset_stateful_hooks()
    outs = []
    with torch.inference_mode():
        for i in range(steps):
            with model.cache_context("cond"):
                t = torch.tensor([0.9 - 0.01 * i], dtype=torch.bfloat16)
                outs.append(model(**{**x, "timestep": t}, return_dict=False)[0])
    return outs


def test_first_block_cache_in_both_orders() -> None:
    from diffusers import FirstBlockCacheConfig

    x = inputs()
    cache = FirstBlockCacheConfig(threshold=0.2)
    plain = tiny_qwen()
    plain.enable_cache(cache)
    want = _fbc_run(plain, x)
    for patch_first in (True, False):
        model = tiny_qwen()
        if patch_first:
            ditops.patch(model, precision="exact")
        model.enable_cache(cache)
        if not patch_first:
            ditops.patch(model, precision="exact")
        assert all(torch.equal(a, b) for a, b in zip(_fbc_run(model, x), want))
        ditops.unpatch(model)
        assert all(torch.equal(a, b) for a, b in zip(_fbc_run(model, x), want))
