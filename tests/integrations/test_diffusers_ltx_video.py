"""ditops.patch on a tiny diffusers LTXVideoTransformer3DModel built from keyword arguments.

Parity: exact precision is bitwise the unpatched model in fp32, bf16 and fp16, per-sample
and per-token timesteps, with the fused CPU paths counted per forward (not a silent fall
back to the eager expressions); fast precision within the stated tolerance; unpatch
restores. A patched model's life: deep copy, pickle, re-patch, a hook on a bypassed norm
or q norm (diffusers' forward / prologue, bitwise), FirstBlockCache, torch.compile, the
Triton paths. Refusals: changed diffusers functions, q/k norms of two eps. Sparse
self-attention: test_diffusers_ltx_video_sparse.py.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch
from diffusers import LTXVideoTransformer3DModel
from diffusers.models import normalization
from diffusers.models.transformers import transformer_ltx as tl
from torch import nn

import ditops
from ditops.attention.schedule import BlockSparseConfig
from ditops.integrations import PatchError
from tests.integrations.family_life import (
    FamilyContract,
    Life,
    changed,
    refused_whole,
    setting,
)
from tests.integrations.spies import cpu_paths_of

# fast precision: the patched model against the unpatched one, relative to the output's
# scale (bf16/fp16 activations through 2 blocks: a few ulps of the dtype).
FAST_REL_TOL = 2e-2

TINY = dict(
    in_channels=8,
    out_channels=8,
    num_attention_heads=2,
    attention_head_dim=16,
    cross_attention_dim=32,
    num_layers=2,
    caption_channels=12,
)
TEXT = 7
LTX_OPS = ("rms_norm", "adaln_residual", "qk_norm_rope")


def tiny_ltx(dtype: torch.dtype = torch.bfloat16, **overrides: object) -> nn.Module:
    torch.manual_seed(0)
    model = LTXVideoTransformer3DModel(**{**TINY, **overrides})
    with torch.no_grad():  # weights away from 1, so a skipped weight would show
        for block in model.transformer_blocks:
            for attn in (block.attn1, block.attn2):
                attn.norm_q.weight.normal_(1.0, 0.3)
                attn.norm_k.weight.normal_(1.0, 0.3)
    return model.to(dtype).eval()


def inputs(
    dtype: torch.dtype = torch.bfloat16,
    batch: int = 1,
    frames: int = 2,
    hw: int = 4,
    per_token: bool = False,
    t: int = 500,
) -> dict:
    g = torch.Generator().manual_seed(1)
    tokens = frames * hw * hw
    timestep = torch.tensor([t] * batch)
    if per_token:  # LTXConditionPipeline: one timestep per token
        timestep = torch.randint(0, 1000, (batch, tokens), generator=g)
    mask = torch.ones(batch, TEXT)
    mask[:, -2:] = 0  # padded text
    return {
        "hidden_states": torch.randn(batch, tokens, 8, generator=g).to(dtype),
        "encoder_hidden_states": torch.randn(batch, TEXT, 12, generator=g).to(dtype),
        "timestep": timestep,
        "encoder_attention_mask": mask,
        "num_frames": frames,
        "height": hw,
        "width": hw,
        "rope_interpolation_scale": (8 / 25, 32, 32),
    }


def run(model: nn.Module, step: int | None = None, name: str = "cond", **kw) -> torch.Tensor:
    with torch.inference_mode():
        if step is None:
            return model(**kw, return_dict=False)[0]
        with model.cache_context(name, step_index=step):
            return model(**kw, return_dict=False)[0]


cpu_paths = cpu_paths_of(*LTX_OPS)  # counts the calls reaching each op's forward_cpu


def test_norms_with_weights_are_bitwise_too(cpu_paths: dict[str, int]) -> None:
    model = tiny_ltx(torch.float32, norm_elementwise_affine=True)
    with torch.no_grad():
        for block in model.transformer_blocks:
            block.norm1.weight.normal_(1.0, 0.3)
            block.norm2.weight.normal_(1.0, 0.3)
    model = model.bfloat16()
    x = inputs()
    ref = run(model, **x)
    ditops.patch(model, precision="exact")
    assert torch.equal(run(model, **x), ref)
    assert cpu_paths["rms_norm"] == 4


def test_hooks_on_a_bypassed_norm_or_a_q_norm_run_diffusers_code() -> None:
    model, plain = tiny_ltx(), tiny_ltx()
    x = inputs()
    seen: list[int] = []

    def scale(module: nn.Module, args: object, out: torch.Tensor) -> torch.Tensor:
        seen.append(1)
        return out * 2

    for m in (plain, model):
        m.transformer_blocks[1].norm2.register_forward_hook(scale)
    ref = run(plain, **x)
    report = ditops.patch(model, precision="exact")
    summary = report.models["LTXVideoTransformer3DModel"]
    assert summary["fused blocks"] == 1 and summary["unfused blocks"] == 1
    why = report.unfused["LTXVideoTransformer3DModel"]["transformer_blocks.1"]
    assert "norm2 has a torch forward hook" in why
    seen.clear()
    assert torch.equal(run(model, **x), ref) and seen == [1]
    # a hook after the patch, on a q norm the fused prologue bypasses: called as a module
    plain.transformer_blocks[0].attn1.norm_q.register_forward_hook(scale)
    model.transformer_blocks[0].attn1.norm_q.register_forward_hook(scale)
    ref = run(plain, **x)
    seen.clear()
    assert torch.equal(run(model, **x), ref) and len(seen) == 2


def test_a_block_with_a_norm_of_another_kind_runs_diffusers_forward() -> None:
    model = tiny_ltx()
    model.transformer_blocks[0].norm1 = nn.RMSNorm(32, eps=1e-6).bfloat16()
    x = inputs()
    ref = run(model, **x)
    report = ditops.patch(model, precision="exact")
    why = report.unfused["LTXVideoTransformer3DModel"]["transformer_blocks.0"]
    assert "norm1 is a RMSNorm, not diffusers' RMSNorm without bias" in why
    assert "forward" not in vars(model.transformer_blocks[0])
    assert torch.equal(run(model, **x), ref)


def test_other_processors_are_kept_but_refused_with_sparse_attention() -> None:
    from diffusers.models.transformers.transformer_ltx import LTXVideoAttnProcessor

    class MyProcessor(LTXVideoAttnProcessor):
        pass

    model = tiny_ltx()
    mine = MyProcessor()
    model.transformer_blocks[1].attn1.set_processor(mine)
    x = inputs()
    ref = run(model, **x)
    with pytest.raises(PatchError, match=r"transformer_blocks\[1\].attn1.processor is a MyProc"):
        ditops.patch(model, attention=BlockSparseConfig(sparsity=0.5))
    assert not hasattr(model, "_ditops_patch")
    report = ditops.patch(model, precision="exact")
    assert report.models["LTXVideoTransformer3DModel"]["attention processors kept"] == 1
    assert model.transformer_blocks[1].attn1.processor is mine
    assert torch.equal(run(model, **x), ref)


def test_first_block_cache_in_both_orders() -> None:
    from diffusers import FirstBlockCacheConfig

    def steps(model: nn.Module) -> list[torch.Tensor]:
        model._diffusers_hook.reset_stateful_hooks()
        return [run(model, i, **inputs(t=900 - 10 * i)) for i in range(3)]

    cache = FirstBlockCacheConfig(threshold=0.2)
    plain = tiny_ltx()
    plain.enable_cache(cache)
    want = steps(plain)
    patch_first = tiny_ltx()
    ditops.patch(patch_first, precision="exact")
    patch_first.enable_cache(cache)
    assert all(torch.equal(a, b) for a, b in zip(steps(patch_first), want))
    hook_first = tiny_ltx()
    hook_first.enable_cache(cache)
    ditops.patch(hook_first, precision="exact")
    assert all(torch.equal(a, b) for a, b in zip(steps(hook_first), want))


LIFE = Life(
    make=tiny_ltx,
    inputs=lambda: inputs(batch=2),
    run=run,
    attn="attn1",
    processor=tl.LTXVideoAttnProcessor,
    cases=inputs,
)


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (changed(tl, "apply_rotary_emb"), r"transformer_ltx.apply_rotary_emb of diffusers"),
        (changed(normalization.RMSNorm, "forward"), r"RMSNorm.forward of diffusers"),
        (changed(tl.LTXVideoTransformerBlock, "forward"), r"forward \(fingerprint"),
        (changed(tl.LTXVideoAttnProcessor, "__call__"), r"__call__ \(fingerprint"),
        (
            setting("transformer_blocks.0.attn1.norm_k", "eps", 1e-3),
            r"attn1.norm_q and norm_k have different eps",
        ),
    ],
    ids=["rotary", "rms_norm", "block", "processor", "qk_eps"],
)
def test_models_it_was_not_written_for_are_refused_whole(
    change, fragment: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    refused_whole(LIFE, change, fragment, monkeypatch)


def test_patching_again_with_norms_false_unfuses_the_blocks() -> None:
    model = tiny_ltx()
    ditops.patch(model, precision="exact")
    report = ditops.patch(model, norms=False)
    assert report.models["LTXVideoTransformer3DModel"] == {}
    assert "forward" not in vars(model.transformer_blocks[0])


class TestContract(FamilyContract):
    """A patched model's life (tests/integrations/family_life.py): parity, deep copies,
    pickling, patching again, compile first and the Triton paths (one block; attention
    itself runs diffusers' SDPA). LTX-Video serves sparse attention
    (test_diffusers_ltx_video_sparse.py)."""

    test_sparse_attention_is_refused_naming_the_families_that_serve_it = None
    life = LIFE
    exact_cases = [
        (d, {"batch": b, "per_token": p})
        for d, b, p in [("fp32", 1, False), ("bf16", 1, False)]
        + [("bf16", 2, True), ("fp16", 2, False)]
    ]
    fused = {"fused blocks": 2, "fused attention prologues": 2}
    # per forward, 2 blocks: norm1 and norm2, two gated residuals, one prologue each
    cpu_calls = {"rms_norm": 4, "adaln_residual": 4, "qk_norm_rope": 2}
    fast_case = {"batch": 2}
    triton_ops = LTX_OPS
    triton_tolerance = FAST_REL_TOL
    triton_calls = {"rms_norm": 2, "adaln_residual": 2, "qk_norm_rope": 1}

    def weights(self, model: nn.Module) -> list[torch.Tensor]:
        return [model.transformer_blocks[0].attn1.norm_q.weight]

    def small(self) -> Life:
        return replace(LIFE, make=functools.partial(tiny_ltx, num_layers=1))
