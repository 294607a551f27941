"""ditops.patch on a tiny diffusers LTX2VideoTransformer3DModel built from keyword arguments.

Parity: exact precision is bitwise the unpatched model (video and audio outputs) in fp32,
bf16 and fp16, with interleaved and split rotary, LTX-2.3's prompt modulation and gated
attention, with the fused CPU paths counted per forward; fast precision within the stated
tolerance; unpatch restores. A patched model's life: deep copy, pickle, a hook on a
bypassed norm, torch.compile. Sparse video self-attention: dense steps
bitwise, sparse steps at the density asked and close to dense, steps counted per
``cache_context`` branch, a self-attention mask runs dense. Refusals: changed diffusers
functions, STG's perturbed processors with sparse attention.
"""

from __future__ import annotations

import copy
import io
import logging
import pickle

import pytest
import torch
from diffusers import LTX2VideoTransformer3DModel
from torch import nn

import ditops
from ditops.attention.schedule import BlockSparseConfig
from ditops.integrations import PatchError
from tests.integrations.family_life import DTYPES
from tests.integrations.spies import cpu_paths_of
from tests.precision import max_rel_err

# fast precision: as LTX-Video's (bf16/fp16 activations through 2 blocks).
FAST_REL_TOL = 2e-2
# A sparse step drops half the key blocks of every video self-attention: on this random
# tiny model the output moves, but stays aligned with dense.
SPARSE_MIN_COSINE = 0.95

TINY = dict(
    in_channels=8,
    out_channels=8,
    num_attention_heads=2,
    attention_head_dim=16,
    cross_attention_dim=32,
    audio_in_channels=4,
    audio_out_channels=4,
    audio_num_attention_heads=2,
    audio_attention_head_dim=8,
    audio_cross_attention_dim=16,
    num_layers=2,
    caption_channels=12,
)
TEXT, AUDIO = 7, 10


def tiny_ltx2(dtype: torch.dtype = torch.bfloat16, **overrides: object) -> nn.Module:
    torch.manual_seed(0)
    model = LTX2VideoTransformer3DModel(**{**TINY, **overrides})
    with torch.no_grad():  # weights away from 1 and gates away from 0
        for block in model.transformer_blocks:
            block.attn1.norm_q.weight.normal_(1.0, 0.3)
            block.attn1.norm_k.weight.normal_(1.0, 0.3)
            if block.attn1.to_gate_logits is not None:
                block.attn1.to_gate_logits.weight.normal_(0.0, 0.3)
    return model.to(dtype).eval()


def inputs(
    dtype: torch.dtype = torch.bfloat16,
    batch: int = 1,
    frames: int = 2,
    hw: int = 4,
    t: float = 500.0,
) -> dict:
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(batch, TEXT)
    mask[:, -2:] = 0
    rand = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    return {
        "hidden_states": rand(batch, frames * hw * hw, 8),
        "audio_hidden_states": rand(batch, AUDIO, 4),
        "encoder_hidden_states": rand(batch, TEXT, 12),
        "audio_encoder_hidden_states": rand(batch, TEXT, 12),
        "timestep": torch.tensor([t] * batch),
        "sigma": torch.tensor([t / 1000] * batch),
        "encoder_attention_mask": mask,
        "audio_encoder_attention_mask": mask,
        "num_frames": frames,
        "height": hw,
        "width": hw,
        "audio_num_frames": AUDIO,
    }


def run(model: nn.Module, step: int | None = None, name: str = "cond", **kw) -> tuple:
    with torch.inference_mode():
        if step is None:
            return model(**kw, return_dict=False)
        with model.cache_context(name, step_index=step):
            return model(**kw, return_dict=False)


def equal(a: tuple, b: tuple) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


cpu_paths = cpu_paths_of("rms_norm", "adaln_residual", "qk_norm_rope")

VARIANTS = {
    "plain": {},
    "split_rope": {"rope_type": "split"},
    "ltx23": {
        "cross_attn_mod": True,
        "audio_cross_attn_mod": True,
        "gated_attn": True,
        "audio_gated_attn": True,
    },
}


@pytest.mark.parametrize(
    ("dtype", "batch", "variant"),
    [
        ("fp32", 1, "plain"),
        ("bf16", 2, "plain"),
        ("fp16", 1, "plain"),
        ("bf16", 1, "split_rope"),
        ("bf16", 2, "ltx23"),
    ],
)
def test_exact_patch_is_bitwise_equal_and_unpatch_restores(
    dtype: str, batch: int, variant: str, cpu_paths: dict[str, int]
) -> None:
    model = tiny_ltx2(DTYPES[dtype], **VARIANTS[variant])
    x = inputs(DTYPES[dtype], batch=batch)
    ref = run(model, **x)
    report = ditops.patch(model, precision="exact")
    summary = report.models["LTX2VideoTransformer3DModel"]
    assert summary["fused blocks"] == 2
    if variant == "split_rope":
        assert "fused attention prologues" not in summary
        assert summary["attention prologues as diffusers' (split rotary)"] == 2
    else:
        assert summary["fused attention prologues"] == 2
    assert equal(run(model, **x), ref)
    # per forward, 2 blocks: 4 norms and 4 residuals of each stream; the video prologue on
    # the op with interleaved tables only (split's differ per head: diffusers' prologue)
    want = {"rms_norm": 16, "adaln_residual": 16, "qk_norm_rope": 2}
    if variant == "split_rope":
        del want["qk_norm_rope"]
    assert cpu_paths == want
    ditops.unpatch(model)
    assert "forward" not in vars(model.transformer_blocks[0])
    assert type(model.transformer_blocks[0].attn1.processor).__name__ == (
        "LTX2AudioVideoAttnProcessor"
    )
    assert equal(run(model, **x), ref)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_fast_patch_within_tolerance(dtype: str) -> None:
    model = tiny_ltx2(DTYPES[dtype])
    x = inputs(DTYPES[dtype], batch=2)
    ref = run(model, **x)
    ditops.patch(model, precision="fast")
    out = run(model, **x)
    assert all(max_rel_err(o, r) <= FAST_REL_TOL for o, r in zip(out, ref))


def test_a_hook_on_a_bypassed_norm_runs_diffusers_forward() -> None:
    model, plain = tiny_ltx2(), tiny_ltx2()
    x = inputs()
    seen: list[int] = []

    def scale(module: nn.Module, args: object, out: torch.Tensor) -> torch.Tensor:
        seen.append(1)
        return out * 2

    for m in (plain, model):
        m.transformer_blocks[1].audio_to_video_norm.register_forward_hook(scale)
        m.transformer_blocks[0].audio_norm3.register_forward_hook(scale)
    ref = run(plain, **x)
    report = ditops.patch(model, precision="exact")
    assert report.models["LTX2VideoTransformer3DModel"]["unfused blocks"] == 2
    why = report.unfused["LTX2VideoTransformer3DModel"]
    assert "audio_to_video_norm has a torch forward hook" in why["transformer_blocks.1"]
    assert "audio_norm3 has a torch forward hook" in why["transformer_blocks.0"]
    seen.clear()
    assert equal(run(model, **x), ref) and seen == [1, 1]


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("apply_split_rotary_emb", r"apply_split_rotary_emb of diffusers"),
        ("LTX2VideoTransformerBlock.get_mod_params", r"get_mod_params of diffusers"),
        ("LTX2VideoTransformerBlock.forward", r"forward \(fingerprint"),
        ("LTX2AudioVideoAttnProcessor.__call__", r"__call__ \(fingerprint"),
    ],
)
def test_a_changed_diffusers_function_is_refused(
    monkeypatch: pytest.MonkeyPatch, name: str, fragment: str
) -> None:
    from diffusers.models.transformers import transformer_ltx2 as module

    owner, _, attr = name.rpartition(".")
    holder = getattr(module, owner) if owner else module
    original = getattr(holder, attr)

    def changed(*args, **kwargs):
        return original(*args, **kwargs)

    monkeypatch.setattr(
        holder, attr, staticmethod(changed) if attr == "get_mod_params" else changed
    )
    model = tiny_ltx2()
    with pytest.raises(PatchError, match=fragment):
        ditops.patch(model)
    assert not hasattr(model, "_ditops_patch")


def test_perturbed_processors_are_kept_but_refused_with_sparse_attention() -> None:
    """STG's ``LTX2PerturbedAttnProcessor`` (``perturbed_attn=True``): the blocks fused
    around it, bitwise, STG blocks included; sparse attention refused, nothing changed."""
    model = tiny_ltx2(perturbed_attn=True)
    x = {**inputs(), "spatio_temporal_guidance_blocks": [1]}
    ref = run(model, **x)
    with pytest.raises(PatchError, match=r"attn1.processor is a LTX2PerturbedAttnProcessor"):
        ditops.patch(model, attention=BlockSparseConfig(sparsity=0.5))
    assert not hasattr(model, "_ditops_patch")
    report = ditops.patch(model, precision="exact")
    summary = report.models["LTX2VideoTransformer3DModel"]
    assert summary["fused blocks"] == 2 and summary["attention processors kept"] == 2
    assert equal(run(model, **x), ref)


def test_deep_copy_and_pickle() -> None:
    """(diffusers 0.42's FirstBlockCache does not register LTX2VideoTransformerBlock: the
    hook test above is this family's cache-hook test.)"""
    model = tiny_ltx2()
    x = inputs()
    ref = run(model, **x)
    ditops.patch(model, precision="exact")
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.transformer_blocks[0].attn1.norm_q.weight.mul_(0.5)
    changed = run(twin, **x)
    assert not torch.equal(changed[0], ref[0]) and equal(run(model, **x), ref)
    ditops.unpatch(twin)
    assert equal(run(twin, **x), changed)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    assert equal(run(torch.load(buf, weights_only=False), **x), ref)
    assert pickle.loads(pickle.dumps(model))._ditops_patch.options == model._ditops_patch.options


@pytest.mark.slow
def test_compile_fullgraph_without_recompiles() -> None:
    torch._dynamo.reset()
    x = inputs()
    model = tiny_ltx2(num_layers=1)
    ditops.patch(model, precision="exact")
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        first = run(compiled, **x)
        again = run(compiled, **x)
    torch._dynamo.reset()
    assert equal(first, again) and equal(first, run(tiny_ltx2(num_layers=1), **x))


# --- sparse video self-attention -------------------------------------------------------------


def _densities(calls: list) -> list[float]:
    return [float(counts.float().mean() / mask.shape[-1]) for mask, counts in calls]


@pytest.mark.parametrize(("variant", "norms"), [("plain", True), ("ltx23", True), ("plain", False)])
def test_sparse_density_asked_is_run_and_dense_steps_are_bitwise(
    variant: str, norms: bool, estimates: list
) -> None:
    """As LTX2Pipeline calls it (cache_context branches without a step index): step 0 dense
    and bitwise, step 1 block-sparse at density 0.5 in the video self-attention only (4
    frames of 8 x 8 tokens: 16 key blocks of 16, the first frame's 4 dense), audio dense."""
    model = tiny_ltx2(**VARIANTS[variant])
    x = inputs(frames=4, hw=8)
    later = {**x, "timestep": torch.tensor([400.0]), "sigma": torch.tensor([0.4])}
    ref, ref_later = run(model, **x), run(model, **later)
    cfg = BlockSparseConfig(sparsity=0.5, skip_first_steps=1, block_size=16, stride=4)
    report = ditops.patch(model, precision="exact", norms=norms, attention=cfg)
    assert report.models["LTX2VideoTransformer3DModel"]["sparse self-attentions"] == 2

    def call(kw: dict, branch: str = "cond_uncond") -> tuple:
        with torch.inference_mode(), model.cache_context(branch):
            return model(**kw, return_dict=False)

    assert equal(call(x), ref) and estimates == []  # step 0: dense
    assert equal(call(x, "uncond_stg"), ref) and estimates == []  # another branch: step 0
    sparse = call(later)
    assert model._ditops_steps.current() == 1 and len(estimates) == 2
    assert all(abs(d - 0.5) <= 1 / 16 for d in _densities(estimates)), _densities(estimates)
    mask = estimates[0][0]
    assert bool(mask[..., :4, :].all()) and bool(mask[..., :, :4].all())  # the first frame
    for out, want in zip(sparse, ref_later):
        assert not torch.equal(out, want)
        cos = nn.functional.cosine_similarity(out.float().flatten(), want.float().flatten(), 0)
        assert cos > SPARSE_MIN_COSINE, cos
    ditops.unpatch(model)
    assert equal(run(model, **later), ref_later)


def test_a_self_attention_mask_runs_dense_and_says_so(
    estimates: list, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """IC-LoRA's video self-attention mask: diffusers' dense attention with the mask, on
    sparse steps too, bitwise, and a warning."""
    from ditops.integrations.shared import video_sparse

    monkeypatch.setattr(video_sparse, "_WARNED", set())  # said once per process
    model = tiny_ltx2()
    x = inputs(frames=4, hw=8)
    x["video_self_attention_mask"] = (torch.rand(1, 256, 256) > 0.2).float()
    ref = run(model, step=3, **x)
    ditops.patch(model, precision="exact", attention=BlockSparseConfig(sparsity=0.5))
    with caplog.at_level(logging.WARNING, logger="ditops"):
        assert equal(run(model, step=3, **x), ref)
    assert estimates == [] and "runs dense attention with the mask" in caplog.text


def test_sparse_attention_under_context_parallelism_is_refused() -> None:
    """diffusers 0.42 cannot run LTX-2 under context parallelism (its plan splits the
    video tokens, not the audio-to-video rotary tables): with a parallel config on the
    processors the patch refuses sparse attention, changing nothing; one set after the
    patch is refused at the first sparse step."""
    from diffusers import ContextParallelConfig

    model = tiny_ltx2()
    cfg = BlockSparseConfig(sparsity=0.5)
    procs = [b.attn1.processor for b in model.transformer_blocks]
    for p in procs:
        p._parallel_config = ContextParallelConfig(ulysses_degree=2)
    with pytest.raises(PatchError, match="under context parallelism is not supported for ltx2"):
        ditops.patch(model, attention=cfg)
    assert not hasattr(model, "_ditops_patch")
    for p in procs:
        p._parallel_config = None
    ditops.patch(model, attention=cfg)
    for block in model.transformer_blocks:
        block.attn1.processor._parallel_config = ContextParallelConfig(ulysses_degree=2)
    with pytest.raises(NotImplementedError, match="not supported by LTX2SelfAttnProcessor"):
        run(model, step=3, **inputs(frames=4, hw=8))
