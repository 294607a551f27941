"""ditops.patch on tiny diffusers SD3Transformer2DModels built from keyword arguments:
SD3 (no q/k norm, single attention) and SD3.5 (dual attention in some blocks, q/k
RMSNorm), each with its last block ``context_pre_only``.

Parity: exact precision is bitwise equal to the unpatched model in fp32, bf16 and fp16,
with the fused CPU paths shown to run and counted per forward; fast precision within
tolerance; unpatch restores. Then what a patch must survive: deep copies, pickling,
patching again, hooks on bypassed norms, feed-forward chunking, torch.compile, and
models it must refuse.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch
from diffusers import SD3Transformer2DModel
from diffusers.models import attention, normalization
from diffusers.models.attention_processor import JointAttnProcessor2_0
from torch import nn

import ditops
from tests.integrations.family_life import (
    DTYPES,
    FamilyContract,
    Life,
    OffloadContract,
    changed,
    first_output,
    refused_whole,
)
from tests.integrations.spies import cpu_paths_of

FAST_REL_TOL = 2e-2  # as FLUX's: bf16/fp16 activations through 3 blocks, a few ulps

TINY = dict(
    sample_size=8,
    patch_size=2,
    in_channels=4,
    num_layers=3,
    attention_head_dim=8,
    num_attention_heads=2,
    joint_attention_dim=20,
    caption_projection_dim=16,
    pooled_projection_dim=12,
    out_channels=4,
    pos_embed_max_size=12,
)
#: SD3.5: dual attention in the first block only (the second is SD3's, the third the last).
SD35 = dict(dual_attention_layers=(0,), qk_norm="rms_norm")
TEXT = 5


def tiny_sd3(dtype: torch.dtype = torch.bfloat16, **overrides: object) -> SD3Transformer2DModel:
    torch.manual_seed(0)
    model = SD3Transformer2DModel(**{**TINY, **overrides}).to(dtype).eval()
    with torch.no_grad():  # norm weights away from 1, so the prologue's weights count
        for name, p in model.named_parameters():
            if ".norm_" in name and name.endswith("weight"):
                p.copy_(1 + 0.5 * torch.randn_like(p))
    return model


def inputs(dtype: torch.dtype = torch.bfloat16, batch: int = 1) -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "hidden_states": torch.randn(batch, 4, 8, 6, generator=g).to(dtype) * 2,
        "encoder_hidden_states": torch.randn(batch, TEXT, 20, generator=g).to(dtype),
        "pooled_projections": torch.randn(batch, 12, generator=g).to(dtype),
        "timestep": torch.tensor([700.0, 30.0][:batch], dtype=dtype),
    }


run = first_output


cpu_paths = cpu_paths_of("adaln_modulate", "adaln_residual", "adaln_residual_modulate", "rms_norm")

CASES = [("fp32", 1), ("bf16", 1), ("bf16", 2), ("fp16", 2)]


@pytest.mark.parametrize(("dtype", "batch"), CASES)
def test_sd3_exact_is_bitwise_equal_and_unpatch_restores(
    dtype: str, batch: int, cpu_paths: dict[str, int]
) -> None:
    model = tiny_sd3(DTYPES[dtype])
    x = inputs(DTYPES[dtype], batch)
    ref = run(model, **x)
    report = ditops.patch(model, precision="exact")
    # no q/k norms (SD3.0): diffusers' processors stay, counted as kept
    assert report.models["SD3Transformer2DModel"] == {
        "fused blocks": 3,
        "fused output norm": 1,
        "attention processors kept": 3,
    }
    assert torch.equal(run(model, **x), ref)
    # 3 blocks: 2 modulated norms each (the last one's text norm is the continuous one),
    # + norm_out; residual+norm per stream with an MLP half (2 + 2 + 1); the MLPs' residuals
    assert cpu_paths == {
        "adaln_modulate": 3 * 2 + 1,
        "adaln_residual_modulate": 5,
        "adaln_residual": 5,
    }
    ditops.unpatch(model)
    assert "forward" not in vars(model.transformer_blocks[0])
    assert torch.equal(run(model, **x), ref)


@pytest.mark.parametrize(("dtype", "batch"), CASES)
def test_sd35_exact_is_bitwise_equal_and_unpatch_restores(
    dtype: str, batch: int, cpu_paths: dict[str, int]
) -> None:
    model = tiny_sd3(DTYPES[dtype], **SD35)
    x = inputs(DTYPES[dtype], batch)
    ref = run(model, **x)
    report = ditops.patch(model, precision="exact")
    assert report.models["SD3Transformer2DModel"] == {
        "fused blocks": 3,
        "fused output norm": 1,
        "fused attention prologues": 4,
    }
    assert torch.equal(run(model, **x), ref)
    # as SD3, plus the dual block's second modulation and its extra residual; the q/k
    # norms: 4 per joint attention (3), 2 for attn2
    assert cpu_paths == {
        "adaln_modulate": 3 * 2 + 1 + 1,
        "adaln_residual_modulate": 5,
        "adaln_residual": 5 + 1,
        "rms_norm": 3 * 4 + 2,
    }
    processor = model.transformer_blocks[0].attn2.processor
    assert type(processor).__name__ == "FusedSD3AttnProcessor"
    ditops.unpatch(model)
    blocks = model.transformer_blocks
    assert type(blocks[0].attn2.processor).__name__ == "JointAttnProcessor2_0"
    assert blocks[0].attn2.processor is blocks[0].attn.processor  # shared, as built
    assert torch.equal(run(model, **x), ref)


def test_processor_calls_match_the_original_in_values_and_strides() -> None:
    """Self-attention (attn2) and joint calls, directly: the same bits and the same
    layout as diffusers' processor, whose norms see the transposed view."""
    model = tiny_sd3(torch.bfloat16, **SD35)
    ditops.patch(model, precision="exact")
    g = torch.Generator().manual_seed(3)
    h = torch.randn(2, 9, 16, generator=g).bfloat16()
    c = torch.randn(2, 4, 16, generator=g).bfloat16()
    for attn, context in (
        (model.transformer_blocks[0].attn2, None),
        (model.transformer_blocks[2].attn, c),
    ):
        with torch.inference_mode():
            got = attn.processor(attn, h, context)
            want = attn.processor.original(attn, h, context)
        for a, b in zip(
            got if context is not None else [got], want if context is not None else [want]
        ):
            assert torch.equal(a, b) and a.stride() == b.stride()


def test_feed_forward_chunking_is_bitwise() -> None:
    model = tiny_sd3(torch.bfloat16, **SD35)
    model.enable_forward_chunking(chunk_size=1, dim=1)  # 12 image, 5 text tokens
    x = inputs(batch=2)
    ref = run(model, **x)
    ditops.patch(model, precision="exact")
    assert torch.equal(run(model, **x), ref)


def test_other_qk_norms_keep_the_processor_and_fuse_the_blocks() -> None:
    model = tiny_sd3(torch.float32, qk_norm="layer_norm")
    x = inputs(torch.float32)
    ref = run(model, **x)
    report = ditops.patch(model, precision="exact")
    summary = report.models["SD3Transformer2DModel"]
    assert summary["attention processors kept"] == 3 and summary["fused blocks"] == 3
    assert torch.equal(run(model, **x), ref)


def test_other_processors_are_kept_and_the_blocks_still_fused() -> None:
    class MyProcessor(JointAttnProcessor2_0):
        pass

    model = tiny_sd3(**SD35)
    mine = MyProcessor()
    model.transformer_blocks[1].attn.set_processor(mine)
    x = inputs()
    ref = run(model, **x)
    summary = ditops.patch(model, precision="exact").models["SD3Transformer2DModel"]
    assert summary["fused attention prologues"] == 3
    assert summary["attention processors kept"] == 1
    assert model.transformer_blocks[1].attn.processor is mine
    assert torch.equal(run(model, **x), ref)


def test_hooks_on_bypassed_norms_run_diffusers_code_bitwise() -> None:
    """A torch hook on a block's norm2 runs that block unfused; one on a q/k norm runs
    that processor's original code; both hooks see their calls; still bitwise."""
    model = tiny_sd3(**SD35)
    x = inputs()
    ref = run(model, **x)
    ditops.patch(model, precision="exact")
    seen: list[str] = []
    block = model.transformer_blocks[0]
    block.norm2.register_forward_hook(lambda *a: seen.append("norm2"))
    block.attn.norm_added_k.register_forward_hook(lambda *a: seen.append("norm_added_k"))
    assert torch.equal(run(model, **x), ref)
    assert seen == ["norm_added_k", "norm2"]
    where = ditops.explain_patch(model)["SD3Transformer2DModel"]
    assert where["transformer_blocks.0"] == "norm2 has a torch forward hook"
    assert where["transformer_blocks.2"] == "fused"  # the last: norm2_context None, watched


def test_a_module_set_where_the_last_block_had_none_is_seen() -> None:
    """The last block's norm2_context is None when patched: it stays watched, so a module
    set there afterwards runs that block as diffusers does, and explain_patch says why."""
    model = tiny_sd3(**SD35)
    x = inputs()
    ref = run(model, **x)
    ditops.patch(model, precision="exact")
    last = model.transformer_blocks[-1]
    assert last.norm2_context is None
    last.norm2_context = nn.LayerNorm(last.norm2.normalized_shape, elementwise_affine=False)
    where = ditops.explain_patch(model)["SD3Transformer2DModel"]
    assert where[f"transformer_blocks.{len(model.transformer_blocks) - 1}"] == (
        "norm2_context is a LayerNorm, not the NoneType patched"
    )
    assert torch.equal(run(model, **x).float(), ref.float())


def test_a_processor_built_by_a_loader_is_the_original() -> None:
    """diffusers' loaders build ``type(p)()``: no ops, JointAttnProcessor2_0's own code."""
    from ditops.integrations.sd3.forwards import FusedSD3AttnProcessor

    model = tiny_sd3(**SD35)
    attn = model.transformer_blocks[0].attn
    h, c = torch.randn(1, 6, 16).bfloat16(), torch.randn(1, 3, 16).bfloat16()
    with torch.inference_mode():
        got = FusedSD3AttnProcessor()(attn, h, c)
        want = attn.processor(attn, h, c)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_block_with_a_norm_of_another_kind_runs_diffusers_forward() -> None:
    model = tiny_sd3(**SD35)
    model.transformer_blocks[1].norm2 = nn.LayerNorm(16, elementwise_affine=True).bfloat16()
    nn.init.normal_(model.transformer_blocks[1].norm2.weight)
    x = inputs()
    ref = run(model, **x)
    report = ditops.patch(model, precision="exact")
    why = report.unfused["SD3Transformer2DModel"]["transformer_blocks.1"]
    assert "norm2 is a LayerNorm, not a LayerNorm without affine" in why
    assert report.models["SD3Transformer2DModel"]["fused blocks"] == 2
    assert torch.equal(run(model, **x), ref)


LIFE = Life(
    make=functools.partial(tiny_sd3, **SD35),
    inputs=lambda: inputs(batch=2),
    processor=JointAttnProcessor2_0,
    cases=inputs,
)


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (
            changed(attention.JointTransformerBlock, "forward"),
            r"transformer_blocks\[0\] is a JointTransformerBlock whose forward",
        ),
        (
            changed(JointAttnProcessor2_0, "__call__"),
            r"JointAttnProcessor2_0.__call__ \(fingerprint \w+\) differs",
        ),
        (
            changed(normalization.SD35AdaLayerNormZeroX, "forward"),
            r"SD35AdaLayerNormZeroX.forward of diffusers .* differs",
        ),
    ],
    ids=["block", "processor", "norm"],
)
def test_refused_whole_changing_nothing(
    change, fragment: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    refused_whole(LIFE, change, fragment, monkeypatch)


def test_norms_false_changes_nothing_but_records_the_patch() -> None:
    model = tiny_sd3(**SD35)
    assert ditops.patch(model, norms=False).models["SD3Transformer2DModel"] == {}
    assert "forward" not in vars(model.transformer_blocks[0])


class TestContract(FamilyContract, OffloadContract):
    """A patched model's life (tests/integrations/family_life.py): sparse attention refused,
    deep copies, pickling, patching again, compile first, the Triton paths (one
    dual-attention block and the last block), offload in both orders."""

    life = LIFE
    # its parity in exact precision: SD3.0 and SD3.5 above (SD3.5's attn2 shares a processor)
    test_exact_patch_is_bitwise_equal_and_unpatch_restores = None
    fast_case = {"batch": 2}
    triton_ops = ("adaln_modulate", "adaln_residual_modulate", "adaln_residual", "rms_norm")
    triton_tolerance = FAST_REL_TOL
    # modulations: 3 (dual: norm1 twice) + 2 + 1 (norm_out); residual+norm: 2 + 1 (the
    # last block has no text MLP); residuals: 3 (dual: attn's) + 1; q/k norms: 4 + 2 + 4
    triton_calls = {
        "adaln_modulate": 6,
        "adaln_residual_modulate": 3,
        "adaln_residual": 4,
        "rms_norm": 10,
    }
    offload_fixtures = ("cpu_paths",)

    def weights(self, model: nn.Module) -> list[torch.Tensor]:
        return [block.attn.norm_q.weight for block in model.transformer_blocks]

    def small(self) -> Life:
        return replace(LIFE, make=functools.partial(tiny_sd3, num_layers=2, **SD35))

    def offloaded(self, places: dict[str, str], mode: str, cpu_paths: dict[str, int]) -> None:
        """The blocks stay fused under every mode (the norms they bypass hold no
        parameters, so no offload hooks them); under sequential and leaf-level offload the
        q/k norms (weights) carry hooks and the processors run diffusers' code, the norms
        onloaded by their hooks."""
        assert all(places[f"transformer_blocks.{i}"] == "fused" for i in range(3)), places
        hooked = mode in ("sequential", "group-leaf")
        assert cpu_paths.get("rms_norm", 0) == (0 if hooked else 3 * 4 + 2)
