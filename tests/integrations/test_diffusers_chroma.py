"""ditops.patch on a tiny diffusers ChromaTransformer2DModel built from keyword arguments.

Parity: exact precision is bitwise equal to the unpatched model in fp32, bf16 and fp16
(fp16 also exercises the clipping), with and without Chroma's text mask, the fused CPU
paths shown to run and counted per forward; fast precision within tolerance; unpatch
restores. Then what a patch must survive: deep copies, pickling, patching again,
diffusers' layerwise casting, hooks on bypassed norms, torch.compile, and models it
must refuse.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ditops
from ditops.attention.schedule import BlockSparseConfig
from ditops.integrations import PatchError
from tests.integrations.lifecycle import (
    change_source,
    check_compile_fullgraph,
    check_deep_copy,
    check_offload,
    check_pickles_and_patches_again,
    check_triton_paths,
)
from tests.integrations.spies import FLUX_OPS, cpu_paths_of
from tests.precision import max_rel_err

diffusers = pytest.importorskip(
    "diffusers", reason="the diffusers extra is part of the test install"
)
from diffusers import ChromaTransformer2DModel  # noqa: E402

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
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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


def run(model: nn.Module, **kw: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(**kw, return_dict=False)[0]


cpu_paths = cpu_paths_of(*FLUX_OPS)


@pytest.mark.parametrize(
    ("dtype", "batch", "mask"),
    [("fp32", 1, False), ("bf16", 1, False), ("bf16", 2, True), ("fp16", 2, True)],
)
def test_exact_is_bitwise_equal_and_unpatch_restores(
    dtype: str, batch: int, mask: bool, cpu_paths: dict[str, int]
) -> None:
    model = tiny_chroma(DTYPES[dtype])
    x = inputs(DTYPES[dtype], batch, mask)
    ref = run(model, **x)
    report = ditops.patch(model, precision="exact")
    assert report.models["ChromaTransformer2DModel"] == {
        "fused blocks": 4,
        "fused attention prologues": 4,
        "fused output norm": 1,
    }
    assert torch.equal(run(model, **x), ref)
    # 2 double blocks (2 modulated norms, 2 residual+norm, 2 residuals, 2 prologues: text
    # and image), 2 single blocks (1 each), the output norm
    assert cpu_paths == {
        "adaln_modulate": 2 * 2 + 2 + 1,
        "adaln_residual_modulate": 2 * 2,
        "adaln_residual": 2 * 2 + 2,
        "qk_norm_rope": 2 * 2 + 2,
    }
    ditops.unpatch(model)
    assert "forward" not in vars(model.transformer_blocks[0])
    assert type(model.transformer_blocks[0].attn.processor).__name__ == "FluxAttnProcessor"
    assert torch.equal(run(model, **x), ref)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fast_within_tolerance(dtype: str) -> None:
    model = tiny_chroma(DTYPES[dtype])
    x = inputs(DTYPES[dtype], batch=2, mask=True)
    ref = run(model, **x)
    ditops.patch(model, precision="fast")
    out = run(model, **x)
    assert out.dtype == ref.dtype
    assert max_rel_err(out, ref) <= FAST_REL_TOL


def test_patched_model_on_the_triton_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every fused op on its Triton path (tests/integrations/lifecycle.py), fast
    precision, with the text mask."""
    from ditops.ops import modulation_model_dtype as adaln
    from ditops.ops import qk_norm_rope

    ops = (
        adaln.AdaLNModulateOp,
        adaln.AdaLNResidualModulateOp,
        adaln.AdaLNResidualOp,
        qk_norm_rope.QKNormRopeOp,
    )
    model, x = tiny_chroma(num_layers=1, num_single_layers=1), inputs(batch=2, mask=True)
    used = check_triton_paths(monkeypatch, model, x, run, ops, FAST_REL_TOL)
    assert used == {
        "adaln_modulate": 4,
        "adaln_residual_modulate": 2,
        "adaln_residual": 3,
        "qk_norm_rope": 3,
    }


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


@pytest.mark.parametrize(
    ("where", "fragment"),
    [
        ("block", r"single_transformer_blocks\[0\] is a ChromaSingleTransformerBlock whose"),
        ("norm", r"ChromaAdaLayerNormZeroPruned.forward of diffusers .* differs"),
        ("qk_eps", r"transformer_blocks\[1\].attn.norm_q and norm_k have different eps"),
        ("sparse", r"sparse attention is supported for WanTransformer3DModel.*not for Chroma"),
    ],
)
def test_refused_whole_changing_nothing(
    monkeypatch: pytest.MonkeyPatch, where: str, fragment: str
) -> None:
    from diffusers.models.transformers import transformer_chroma as tc

    model = tiny_chroma()
    options = {}
    if where == "block":
        change_source(monkeypatch, tc.ChromaSingleTransformerBlock, "forward")
    elif where == "norm":
        change_source(monkeypatch, tc.ChromaAdaLayerNormZeroPruned, "forward")
    elif where == "qk_eps":
        model.transformer_blocks[1].attn.norm_k.eps = 1e-5
    else:
        options = {"attention": BlockSparseConfig(sparsity=0.5)}
    x = inputs()
    ref = run(model, **x)
    with pytest.raises(PatchError, match=fragment):
        ditops.patch(model, **options)
    assert not hasattr(model, "_ditops_patch")
    assert "forward" not in vars(model.transformer_blocks[0])
    assert type(model.transformer_blocks[0].attn.processor).__name__ == "FluxAttnProcessor"
    assert torch.equal(run(model, **x), ref)


# --- a patched model's life -------------------------------------------------------------------


def _halve_q_norms(model: nn.Module) -> None:
    for block in model.transformer_blocks:
        block.attn.norm_q.weight.mul_(0.5)


def test_deep_copy_is_an_independent_patched_model() -> None:
    check_deep_copy(tiny_chroma(), inputs(), run, _halve_q_norms)


def test_patched_model_pickles_and_patches_again() -> None:
    check_pickles_and_patches_again(tiny_chroma(), inputs(batch=2, mask=True), run)


@pytest.mark.slow
def test_compile_fullgraph_without_recompiles() -> None:
    """The patched model compiled before any eager call, fullgraph, no recompile, bitwise
    the unpatched model (tests/integrations/lifecycle.py)."""
    check_compile_fullgraph(
        lambda: tiny_chroma(num_layers=1, num_single_layers=1), inputs(batch=2, mask=True), run
    )


@pytest.mark.parametrize("mode", ["model", "sequential", "group-block", "group-leaf"])
@pytest.mark.parametrize("order", ["offload-first", "patch-first"])
def test_offload_gives_the_unpatched_model_under_the_same_offload(
    mode: str, order: str, tmp_path
) -> None:
    """As tests/integrations/test_offload.py for FLUX: every block stays fused (the
    pruned norms and the LayerNorms they bypass hold no parameters); bitwise the
    unpatched model under the same offload."""
    places = check_offload(tiny_chroma, inputs(batch=2, mask=True), run, mode, order, tmp_path)
    blocks = [v for k, v in places.items() if "blocks." in k or k == "norm_out"]
    assert len(blocks) == 5 and set(blocks) == {"fused"}, places
