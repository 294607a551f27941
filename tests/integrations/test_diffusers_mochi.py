"""ditops.patch on a tiny diffusers MochiTransformer3DModel built from keyword arguments.

Parity: exact precision is bitwise the unpatched model in fp32, bf16 and fp16, with
padded text per sample (a sample with no text at all too), the fused CPU paths shown to
run and counted per forward; fast precision within tolerance; unpatch restores. Then
what a patch must survive (deep copies, pickling, patching again, FirstBlockCache in
both orders, a torch hook on a bypassed norm, torch.compile) and what it must refuse.
Sparse attention: dense steps bitwise, sparse steps at the block density asked (read
from the layer), and with every block kept Mochi's attention (padded text left out).
"""

from __future__ import annotations

import copy
import pickle

import diffusers
import pytest
import torch
from diffusers import MochiTransformer3DModel
from diffusers.models import attention_processor as ap
from diffusers.models.transformers import transformer_mochi as tm
from torch import nn

import ditops
from ditops.attention.schedule import BlockSparseConfig
from tests.integrations.family_life import (
    FamilyContract,
    Life,
    cached_steps,
    changed,
    first_output,
    refused_whole,
    setting,
)
from tests.integrations.spies import cpu_paths_of
from tests.precision import max_rel_err

FAST_REL_TOL = 2e-2
NAME = "MochiTransformer3DModel"
TINY = dict(
    patch_size=2,
    num_attention_heads=2,
    attention_head_dim=16,
    num_layers=2,  # the second is the last: context_pre_only
    pooled_projection_dim=24,
    in_channels=4,
    text_embed_dim=24,
    time_embed_dim=8,
    max_sequence_length=16,
)
TEXT = 9


def tiny_mochi(dtype: torch.dtype = torch.bfloat16, **overrides: object) -> nn.Module:
    torch.manual_seed(0)
    model = MochiTransformer3DModel(**{**TINY, **overrides}).to(dtype).eval()
    with torch.no_grad():
        model.pos_frequencies.normal_()  # zeros (diffusers' init) would not rotate
    return model


def inputs(dtype: torch.dtype = torch.bfloat16, batch: int = 2, empty: bool = False) -> dict:
    """Two samples with 9 and 5 text tokens (``empty``: the second with none)."""
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(batch, TEXT, dtype=torch.long)
    if batch > 1:
        mask[1, 0 if empty else 5 :] = 0
    return {
        "hidden_states": torch.randn(batch, 4, 3, 4, 6, generator=g).to(dtype),
        "encoder_hidden_states": torch.randn(batch, TEXT, 24, generator=g).to(dtype),
        "timestep": torch.tensor([700, 300, 500][:batch]),
        "encoder_attention_mask": mask,
    }


run = first_output


cpu_paths = cpu_paths_of("adaln_modulate", "qk_norm_rope", "rms_norm")

#: One forward: block 0 norms 8 rows sets (norm1..4 of both streams), block 1 (the last:
#: context_pre_only) 5; each attention norms the text's q and k (2) and runs one fused
#: video prologue; the output norm.
PER_FORWARD = {"rms_norm": 8 + 5 + 2 * 2, "qk_norm_rope": 2, "adaln_modulate": 1}
FUSED = {"fused blocks": 2, "fused attention prologues": 2, "fused output norm": 1}


def test_tables_in_another_dtype() -> None:
    """bf16 tables: Mochi rotates in fp32 (so does the op, given them widened); fp64: in
    fp64, so the processor runs Mochi's code."""
    model = tiny_mochi()
    ditops.patch(model, precision="exact")
    attn = model.transformer_blocks[0].attn1
    g = torch.Generator().manual_seed(3)
    h = torch.randn(2, 6, 32, generator=g).bfloat16()
    c = torch.randn(2, 4, 24, generator=g).bfloat16()
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    freqs = torch.randn(6, 2, 8, generator=g)
    for dtype in (torch.bfloat16, torch.float64):
        rope = (freqs.cos().to(dtype), freqs.sin().to(dtype))
        with torch.inference_mode():
            got = attn.processor(attn, h, c, mask, rope)
            want = attn.processor.original(attn, h, c, mask, rope)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_processor_built_by_a_loader_runs_the_original_code() -> None:
    model = tiny_mochi()
    ditops.patch(model, precision="exact")
    built = type(model.transformer_blocks[0].attn1.processor)()
    assert built.ops is None and type(built.original) is ap.MochiAttnProcessor2_0


def test_a_block_with_a_norm_of_another_kind_runs_diffusers_forward() -> None:
    model = tiny_mochi()
    norm = model.transformer_blocks[0].norm3_context
    norm.norm = diffusers.models.normalization.RMSNorm(24, 1e-6, True).bfloat16()  # the text width
    nn.init.normal_(norm.norm.weight)
    x = inputs()
    ref = run(model, **x)
    report = ditops.patch(model, precision="exact")
    assert (
        "norm3_context is a MochiModulatedRMSNorm, not a MochiModulatedRMSNorm over an "
        "RMSNorm without weight" in report.unfused[NAME]["transformer_blocks.0"]
    )
    assert report.models[NAME]["fused blocks"] == 1
    assert torch.equal(run(model, **x), ref)


@pytest.mark.parametrize(
    ("block", "norm", "fewer"),
    [(0, "norm4_context.norm", 8), (1, "norm1_context.norm.norm", 5)],
    ids=["full_block", "last_block"],
)
def test_a_hook_on_a_bypassed_norm_runs_the_block_unfused(
    block: int, norm: str, fewer: int, cpu_paths: dict[str, int]
) -> None:
    model = tiny_mochi()
    x = inputs()
    ref = run(model, **x)
    ditops.patch(model, precision="exact")
    seen = []
    handle = (
        model.transformer_blocks[block]
        .get_submodule(norm)
        .register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    )
    assert torch.equal(run(model, **x), ref)
    assert seen == [torch.float32]
    assert cpu_paths["rms_norm"] == PER_FORWARD["rms_norm"] - fewer  # that block's norms
    handle.remove()
    assert torch.equal(run(model, **x), ref)
    assert cpu_paths["rms_norm"] == 2 * PER_FORWARD["rms_norm"] - fewer


LIFE = Life(
    make=tiny_mochi,
    inputs=inputs,
    attn="attn1",
    processor=ap.MochiAttnProcessor2_0,
    cases=inputs,
)


class MyProcessor(ap.MochiAttnProcessor2_0):
    pass


def _own_processor(monkeypatch: pytest.MonkeyPatch, model: nn.Module) -> None:
    monkeypatch.setattr(model.transformer_blocks[0].attn1, "processor", MyProcessor())


SPARSE = {"attention": BlockSparseConfig(sparsity=0.5)}


@pytest.mark.parametrize(
    ("change", "options", "fragment"),
    [
        (
            changed(tm.MochiTransformerBlock, "forward"),
            {},
            r"transformer_blocks\[0\] is a MochiTransformerBlock",
        ),
        (
            changed(ap.MochiAttnProcessor2_0, "__call__"),
            {},
            r"attn1.processor .*differs from the versions",
        ),
        (
            changed(tm.MochiModulatedRMSNorm, "forward"),
            {},
            r"MochiModulatedRMSNorm.forward of diffusers",
        ),
        (
            changed(diffusers.models.normalization.MochiRMSNorm, "forward"),
            {},
            r"MochiRMSNorm.forward of",
        ),
        (
            _own_processor,
            SPARSE,
            r"transformer_blocks\[0\].attn1.processor is a MyProcessor, not MochiAttnProcessor2_0",
        ),
        (
            setting("transformer_blocks.1.attn1.norm_k", "eps", 1e-3),
            {},
            r"transformer_blocks\[1\].attn1.norm_q and norm_k differ in eps",
        ),
    ],
    ids=[
        "block",
        "processor",
        "modulated_norm",
        "qk_norm",
        "sparse_with_a_processor_of_yours",
        "qk_eps",
    ],
)
def test_models_it_was_not_written_for_are_refused_whole(
    change, options: dict, fragment: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    refused_whole(LIFE, change, fragment, monkeypatch, **options)


#: Three steps' timesteps, two samples each.
STEPS = [torch.tensor([900 - 10 * i] * 2) for i in range(3)]


def _fbc_run(model: nn.Module, x: dict) -> list[torch.Tensor]:
    model._diffusers_hook.reset_stateful_hooks()
    return cached_steps(model, x, STEPS)


def test_first_block_cache_in_both_orders() -> None:
    from diffusers import FirstBlockCacheConfig

    x = inputs()
    cache = FirstBlockCacheConfig(threshold=0.2)
    plain = tiny_mochi()
    plain.enable_cache(cache)
    want = _fbc_run(plain, x)
    for patch_first in (True, False):
        model = tiny_mochi()
        if patch_first:
            ditops.patch(model, precision="exact")
        model.enable_cache(cache)
        if not patch_first:
            assert ditops.patch(model, precision="exact").models[NAME] == FUSED
        assert all(torch.equal(a, b) for a, b in zip(_fbc_run(model, x), want))


class TestContract(FamilyContract):
    """A patched model's life (tests/integrations/family_life.py): deep copies, pickling,
    patching again, compile first (not fullgraph: Mochi's attention picks each sample's
    text tokens with ``nonzero``, a data-dependent shape, a graph break unpatched too; the
    fused blocks trace), the Triton paths (the RMSNorms without weight in fp32, the
    prologue with the heads as the op's batch). Mochi serves sparse attention (below)."""

    test_sparse_attention_is_refused_naming_the_families_that_serve_it = None
    life = LIFE
    exact_cases = [
        (d, {"batch": b, "empty": e})
        for d, b, e in (
            ("fp32", 2, False),
            ("bf16", 1, False),
            ("bf16", 2, True),
            ("fp16", 2, False),
        )
    ]
    fused = FUSED
    cpu_calls = PER_FORWARD
    triton_ops = ("adaln_modulate", "qk_norm_rope", "rms_norm")
    triton_tolerance = FAST_REL_TOL
    triton_calls = PER_FORWARD
    fullgraph = False

    def weights(self, model: nn.Module) -> list[torch.Tensor]:
        return [model.transformer_blocks[0].attn1.norm_q.weight]

    def small(self) -> Life:
        return LIFE


# --- sparse attention ------------------------------------------------------------------------

#: 8 latent frames of 16 x 16 -> 8 token frames of 8 x 8: 512 video tokens; with 9 text
#: tokens and the first frame dense, 5 of 33 key blocks (of 16) dense.
VIDEO = 512
SPARSE_CFG = BlockSparseConfig(sparsity=0.5, skip_first_steps=1, block_size=16, stride=4)


def sparse_inputs(dtype: torch.dtype = torch.bfloat16) -> dict:
    g = torch.Generator().manual_seed(5)
    x = inputs(dtype)
    x["hidden_states"] = torch.randn(2, 4, 8, 16, 16, generator=g).to(dtype)
    return x


@pytest.mark.parametrize("norms", [True, False], ids=["fused", "norms_false"])
def test_sparse_density_asked_is_run_and_dense_steps_are_bitwise(
    norms: bool, estimates: list
) -> None:
    """As MochiPipeline calls it: guidance batched in ``cache_context("cond_uncond")``
    without a step index (the step counted from the timesteps); sparse from step 1."""
    model = tiny_mochi()
    x = sparse_inputs()
    later = {**x, "timestep": torch.tensor([400, 400])}
    ref, ref_later = run(model, **x), run(model, **later)
    report = ditops.patch(model, precision="exact", norms=norms, attention=SPARSE_CFG)
    assert report.models[NAME]["sparse self-attentions"] == 2
    assert model._ditops_steps.patch_size == (1, 2, 2)
    assert torch.equal(_guided(model, x), ref)  # step 0: dense, bitwise
    assert estimates == []
    sparse = _guided(model, later)  # step 1 (its timestep is lower): sparse
    assert model._ditops_steps.current() == 1
    assert len(estimates) == 2 * 2  # step 1: every block, every sample
    key_blocks = -(-(VIDEO + TEXT) // 16)
    for block in model.transformer_blocks:  # the density the layer reports: the one asked
        reported = block.attn1.processor.sparse.last_density()
        assert reported.block_density == pytest.approx(0.5, abs=1 / (32 * key_blocks))
    # half the blocks dropped: the output's direction within 1e-2 of dense (measured
    # 1 - 2.7e-3 on this tiny random model); not bitwise
    cos = torch.nn.functional.cosine_similarity(
        sparse.float().flatten(), ref_later.float().flatten(), 0
    )
    assert not torch.equal(sparse, ref_later)
    assert cos > 0.99, cos
    assert torch.equal(_guided(model, x), ref)  # a new pipeline call: dense again


def _guided(model: nn.Module, x: dict) -> torch.Tensor:
    with torch.inference_mode(), model.cache_context("cond_uncond"):
        return model(**x, return_dict=False)[0]


def test_sparse_path_with_every_block_kept_is_mochis_attention(
    every_block_kept: list,
) -> None:
    """fp32, the estimate replaced by one keeping every block: the split by queries, the
    kept text keys first and the padded ones left out give Mochi's attention (fp32
    attention's tolerance), padded text made huge so that any use of it would show; the
    leading dense blocks cover the kept text and the first frame."""
    model = tiny_mochi(torch.float32)
    x = sparse_inputs(torch.float32)
    x["encoder_hidden_states"][1, 5:] *= 1e3  # the second sample's padded text
    ref = run(model, **x)
    ditops.patch(model, precision="exact", attention=BlockSparseConfig(sparsity=0.5, block_size=16))
    with torch.inference_mode(), model.cache_context("cond", step_index=0):
        out = model(**x, return_dict=False)[0]
    assert [kept[:3] for kept in every_block_kept] == [
        (VIDEO, VIDEO + 9, -(-(9 + 64) // 16)),
        (VIDEO, VIDEO + 5, -(-(5 + 64) // 16)),
    ] * 2
    assert max_rel_err(out, ref) < 1e-5


def test_a_sparse_patched_models_copies_keep_their_own_steps() -> None:
    """Deep copy and pickle of a sparse-patched model: each copy counts its own steps and
    runs the same sparse step as the original."""
    model = tiny_mochi()
    x = sparse_inputs()
    later = {**x, "timestep": torch.tensor([400, 400])}
    ditops.patch(model, precision="exact", attention=SPARSE_CFG)
    twin = copy.deepcopy(model)
    loaded = pickle.loads(pickle.dumps(model))
    outs = [[_guided(m, x), _guided(m, later)] for m in (model, twin, loaded)]
    for m in (twin, loaded):
        assert m._ditops_steps is not model._ditops_steps
        assert m.transformer_blocks[0].attn1.processor.steps is m._ditops_steps
    assert all(torch.equal(a, b) for other in outs[1:] for a, b in zip(outs[0], other))


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_process")
def test_sparse_attention_refuses_a_fullgraph_compile() -> None:
    """Mochi's attention reads each sample's text mask on the host: ditops says so,
    naming the option, rather than dynamo's own graph-break error."""
    model = tiny_mochi()
    ditops.patch(model, attention=SPARSE_CFG)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="Mochi's sparse attention cannot compile with fullgraph"):
        with torch.inference_mode(), compiled.cache_context("cond", step_index=1):
            compiled(**inputs(), return_dict=False)
