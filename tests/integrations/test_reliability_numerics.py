"""NaN where the meaning gives NaN, and float64 (issue 25, items 3 and 4).

* HunyuanVideo(-1.5) with one sample's text fully padded: the unpatched model gives NaN
  for that sample (its text embedding pools over no token, so the padded text tokens
  are NaN, and attention with the key mask takes ``0 * NaN`` from them). ditops' sparse
  steps leave the padded keys out, which hid the NaN; now a sample whose padded text
  keys or values are not finite runs its attention dense with the mask, as the meaning.
* float64: ditops' fused blocks are not bitwise diffusers' arithmetic in float64
  (diffusers rotates in fp32), and the sparse estimate takes no float64: every family
  with fused blocks or sparse attention refuses a float64 model at ``patch``, changing
  nothing, instead of a silent difference or a TypeError mid-denoising.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import ditops
from ditops.attention.schedule import BlockSparseConfig
from ditops.integrations import PatchError
from tests.integrations import test_diffusers_flux as flux_t
from tests.integrations import test_diffusers_hunyuan_video as hv_t
from tests.integrations import test_diffusers_hunyuan_video15 as hv15_t
from tests.integrations import test_diffusers_wan as wan_t

SPARSE = BlockSparseConfig(sparsity=0.5, skip_first_steps=1, block_size=16, stride=4)


def _padded(x: dict, how: str) -> dict:
    if how == "fully_padded":  # sample 1: every text token padded
        for name in ("encoder_attention_mask", "encoder_attention_mask_2"):
            if name in x:
                x[name][1] = 0
    else:  # a NaN in a padded text token of sample 0 (its last token is padded)
        x["encoder_hidden_states"][0, -1, 0] = float("nan")
    return x


#: (family, dtype, how, the samples the unpatched model gives NaN for). HunyuanVideo-1.5
#: masks padded text as queries too and pools its text otherwise: a fully padded sample
#: stays finite there.
CASES = [
    ("hunyuan_video", torch.float32, "fully_padded", [False, True]),
    ("hunyuan_video", torch.bfloat16, "fully_padded", [False, True]),
    ("hunyuan_video", torch.bfloat16, "nan_in_padding", [True, False]),
    ("hunyuan_video15", torch.bfloat16, "fully_padded", [False, False]),
]


@pytest.mark.parametrize(("family", "dtype", "how", "nan"), CASES)
def test_padded_text_gives_nan_where_the_unpatched_model_does(
    family: str, dtype: torch.dtype, how: str, nan: list[bool]
) -> None:
    if family == "hunyuan_video":
        model, run = hv_t.tiny_hunyuan(dtype), hv_t.run
        x = _padded(hv_t.inputs(dtype, batch=2, frames=4, hw=16), how)
    else:
        model, run = hv15_t.tiny_model(dtype), hv15_t.run
        x = _padded(hv15_t.inputs(dtype, batch=2, frames=4, hw=16), how)
    later = {**x, "timestep": torch.tensor([400, 400]).to(x["timestep"].dtype)}
    ref, ref_later = run(model, **x), run(model, **later)
    assert [bool(ref_later[b].isnan().all()) for b in (0, 1)] == nan  # the meaning
    ditops.patch(model, precision="exact", attention=SPARSE)
    dense = run(model, "cond", **x)  # step 0: dense, bitwise
    torch.testing.assert_close(dense, ref, rtol=0, atol=0, equal_nan=True)
    sparse = run(model, "cond", **later)  # step 1: sparse
    assert model._ditops_steps.current() == 1 or model._ditops_steps.counted == 1
    assert torch.equal(sparse.isnan(), ref_later.isnan())
    # the other sample stays sparse: finite where the unpatched model is finite
    assert torch.isfinite(sparse[0]).all() == torch.isfinite(ref_later[0]).all()


def _wan64() -> nn.Module:
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(**wan_t.TINY).eval().double()


#: family -> a float64 model
FLOAT64: dict[str, Callable[[], nn.Module]] = {
    "wan": _wan64,
    "flux": lambda: flux_t.tiny_flux(torch.float64),
    "hunyuan_video": lambda: hv_t.tiny_hunyuan(torch.float64),
    "hunyuan_video15": lambda: hv15_t.tiny_model(torch.float64),
}


OPTIONS = {
    "exact": {"precision": "exact"},
    "fast": {"precision": "fast"},
    "default": {},
    "sparse_only": {"norms": False, "attention": BlockSparseConfig(sparsity=0.5)},
}


@pytest.mark.parametrize(
    ("family", "options"),
    [
        (f, o)
        for f in sorted(FLOAT64)
        for o in sorted(OPTIONS)
        if not (f == "flux" and o == "sparse_only")  # FLUX has no sparse attention
    ],
)
def test_float64_is_refused_at_patch_changing_nothing(family: str, options: str) -> None:
    model = FLOAT64[family]()
    before = {name: type(m) for name, m in model.named_modules()}
    with pytest.raises(PatchError, match="float64.*float32, bfloat16 and float16"):
        ditops.patch(model, **OPTIONS[options])
    assert not hasattr(model, "_ditops_patch")
    assert {name: type(m) for name, m in model.named_modules()} == before
    assert not any("forward" in vars(m) for m in model.modules())


def test_float64_with_nothing_fused_is_accepted() -> None:
    model = FLOAT64["wan"]()
    report = ditops.patch(model, norms=False)
    assert report.models["WanTransformer3DModel"] == {}


def test_a_patched_model_refused_in_float64_stays_as_patched() -> None:
    model = wan_t.tiny_wan(keep_fp32=False)
    ditops.patch(model, precision="exact")
    record = model._ditops_patch
    model.double()
    with pytest.raises(PatchError, match="float64"):
        ditops.patch(model, precision="fast")
    assert model._ditops_patch is record and record.options.precision == "exact"


def test_float64_norms_of_a_generic_model_stay_bitwise() -> None:
    """The generic family only swaps FP32LayerNorm, which computes in fp32 as diffusers'."""
    from diffusers.models.normalization import FP32LayerNorm

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)
            self.norm = FP32LayerNorm(16, eps=1e-6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(self.lin(x))

    model = Tiny().double()
    x = torch.randn(3, 16, dtype=torch.float64)
    ref = model(x)
    for precision in ("exact", None):
        ditops.patch(model, precision=precision)
        assert torch.equal(model(x), ref)


def _as64(x: dict) -> dict:
    return {
        k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        for k, v in x.items()
    }


#: family -> (a float32 model, float64 inputs, run(model, step, **x))
CAST_LATER: dict[
    str, tuple[Callable[[], nn.Module], Callable[[], dict], Callable[..., torch.Tensor]]
] = {
    "wan": (
        lambda: _wan64().float(),
        lambda: _as64(wan_t.inputs(frames=4, hw=16)),
        lambda m, step, **x: wan_t.run(m, step=step, **x),
    ),
    "flux": (
        lambda: flux_t.tiny_flux(torch.float32),
        lambda: flux_t.inputs(torch.float64),
        lambda m, step, **x: flux_t.run(m, **x),
    ),
    "hunyuan_video": (
        lambda: hv_t.tiny_hunyuan(torch.float32),
        lambda: hv_t.inputs(torch.float64, frames=4, hw=16),
        lambda m, step, **x: hv_t.run(m, "cond", **x),
    ),
    "hunyuan_video15": (
        lambda: hv15_t.tiny_model(torch.float32),
        lambda: _as64(hv15_t.inputs(torch.float64, frames=4, hw=16)),
        lambda m, step, **x: hv15_t.run(m, "cond", **x),
    ),
}


@pytest.mark.parametrize("family", sorted(CAST_LATER))
def test_a_model_cast_to_float64_after_its_patch_runs_diffusers_code(family: str) -> None:
    """No late TypeError from the estimate and no silent difference: float64 calls run
    diffusers' own forwards and attention (bitwise the unpatched float64 model)."""
    import copy

    make, inputs, run = CAST_LATER[family]
    model = make()
    reference = copy.deepcopy(model).double()
    sparse = None if family == "flux" else BlockSparseConfig(sparsity=0.5, block_size=16, stride=4)
    ditops.patch(model, precision="exact", attention=sparse)
    model.double()
    x = inputs()
    assert torch.equal(run(model, 1, **x), run(reference, 1, **x))
