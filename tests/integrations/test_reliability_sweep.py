"""A sweep of edges, as a new user meets them (issue 25, "a sweep of your own").

For each family and option: the edge values (one frame, a video smaller than a block,
batch 1 and 2, one text token or one valid one, non-contiguous inputs, fp16 overflow,
NaN and inf inputs): the exact patch's dense steps are bitwise the unpatched model (NaN
where it has NaN), the sparse steps put NaN and inf where the unpatched model does and
stay close elsewhere. Then the patch's life (a re-patch keeps a hand-set step; threads)
and wrong values of the options, refused when given.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable

import pytest
import torch
from torch import nn

import ditops
from ditops.attention.schedule import BlockSparseConfig
from tests.integrations import test_diffusers_flux as flux_t
from tests.integrations import test_diffusers_hunyuan_video as hv_t
from tests.integrations import test_diffusers_hunyuan_video15 as hv15_t
from tests.integrations import test_diffusers_wan as wan_t

SPARSE = BlockSparseConfig(sparsity=0.5, skip_first_steps=1, block_size=16, stride=4)


def _step_run(model: nn.Module, step: int, x: dict) -> torch.Tensor:
    with torch.inference_mode(), model.cache_context("cond", step_index=step):
        return model(**x, return_dict=False)[0]


def _wan() -> nn.Module:
    return wan_t.tiny_wan(keep_fp32=True)


def _wan16() -> nn.Module:
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(**wan_t.TINY).eval().half()


def _with(x: dict, **changes: Callable[[torch.Tensor], torch.Tensor]) -> dict:
    return {**x, **{k: f(x[k]) for k, f in changes.items()}}


def _poke(value: float, where: tuple) -> Callable[[torch.Tensor], torch.Tensor]:
    def f(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t[where] = value
        return t

    return f


def _noncontiguous(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


def _batch2_wan() -> dict:
    x = wan_t.inputs(frames=4, hw=16)
    return {
        "hidden_states": torch.cat([x["hidden_states"], -x["hidden_states"]]),
        "timestep": torch.tensor([500, 400]),
        "encoder_hidden_states": torch.cat([x["encoder_hidden_states"]] * 2),
    }


def _hv_one_valid_token() -> dict:
    x = hv_t.inputs(frames=4, hw=16)
    x["encoder_attention_mask"][:, 1:] = 0
    return x


W = wan_t.inputs(frames=4, hw=16)
W16 = {k: v.half() if v.is_floating_point() else v for k, v in W.items()}
NAN_LATENT = _poke(float("nan"), (0, 0, 3, 2, 2))
INF_TEXT = _poke(float("inf"), (0, 0, 0))

#: name -> (model, inputs, sparse attention too); every case patched in exact precision
EDGES: dict[str, tuple[Callable[[], nn.Module], Callable[[], dict], bool]] = {
    "wan one frame": (_wan, lambda: wan_t.inputs(frames=1, hw=16), True),
    "wan video smaller than a block": (_wan, lambda: wan_t.inputs(frames=2, hw=2), True),
    "wan batch 2": (_wan, _batch2_wan, True),
    "wan non-contiguous latents": (_wan, lambda: _with(W, hidden_states=_noncontiguous), True),
    "wan one text token": (_wan, lambda: _with(W, encoder_hidden_states=lambda t: t[:, :1]), True),
    "wan NaN latent": (_wan, lambda: _with(W, hidden_states=NAN_LATENT), True),
    "wan inf text": (_wan, lambda: _with(W, encoder_hidden_states=INF_TEXT), True),
    "wan fp16 overflow": (_wan16, lambda: _with(W16, hidden_states=lambda t: t * 3e4), True),
    "hunyuan_video one frame": (hv_t.tiny_hunyuan, lambda: hv_t.inputs(frames=1, hw=16), True),
    "hunyuan_video batch 2": (
        hv_t.tiny_hunyuan,
        lambda: hv_t.inputs(batch=2, frames=4, hw=16),
        True,
    ),
    "hunyuan_video one valid text token": (hv_t.tiny_hunyuan, _hv_one_valid_token, True),
    "hunyuan_video15 one frame": (hv15_t.tiny_model, lambda: hv15_t.inputs(frames=1, hw=16), True),
    "flux fp16 batch 2": (
        lambda: flux_t.tiny_flux(torch.float16),
        lambda: flux_t.inputs(torch.float16, batch=2),
        False,
    ),
}


def _same_non_finite(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.isinf(), b.isinf())


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("case", sorted(EDGES))
def test_edges_dense_bitwise_and_sparse_where_the_meaning_is(case: str) -> None:
    make, inputs, sparse = EDGES[case]
    model, x = make(), inputs()
    reference = copy.deepcopy(model)
    refs = [_step_run(reference, step, x) for step in (0, 1)]
    ditops.patch(model, precision="exact", attention=SPARSE if sparse else None)
    dense = _step_run(model, 0, x)
    torch.testing.assert_close(dense, refs[0], rtol=0, atol=0, equal_nan=True)
    if not sparse:
        return
    out = _step_run(model, 1, x)
    assert _same_non_finite(out, refs[1])
    finite = torch.isfinite(refs[1])
    if finite.any():
        a, b = out[finite].float(), refs[1][finite].float()
        assert torch.nn.functional.cosine_similarity(a, b, 0) > 0.9


def test_a_re_patch_keeps_a_hand_set_step() -> None:
    model = wan_t.tiny_wan(keep_fp32=False)
    ditops.patch(model, attention=SPARSE)
    ditops.set_step(model, 5)
    ditops.patch(model, attention=BlockSparseConfig(sparsity=0.25))  # options combine
    assert model._ditops_steps.current() == 5
    with pytest.raises(ditops.PatchError):
        ditops.patch(model, precision="fastest")
    assert model._ditops_steps.current() == 5
    ditops.patch(model, attention=None)
    with pytest.raises(ValueError, match="not patched with sparse attention"):
        ditops.set_step(model, 1)


def test_set_step_inside_a_context_on_another_thread_stays_there() -> None:
    model = wan_t.tiny_wan(keep_fp32=False)
    ditops.patch(model, attention=SPARSE)
    seen: list = []

    def worker() -> None:
        with model.cache_context("cond", step_index=0):
            ditops.set_step(model, 9)
            seen.append(model._ditops_steps.current())
        seen.append(model._ditops_steps.current())

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == [9, None]
    assert model._ditops_steps.current() is None and model._ditops_steps.manual is None


#: options given wrong: refused when the config is made, with a ValueError or TypeError
WRONG_CONFIGS: dict[str, dict] = {
    "sparsity 1": {"sparsity": 1.0},
    "sparsity inf": {"sparsity": float("inf")},
    "sparsity nan": {"sparsity": float("nan")},
    "sparsity str": {"sparsity": "0.5"},
    "block_size 0": {"block_size": 0},
    "stride above block": {"block_size": 8, "stride": 16},
    "threshold 0": {"threshold": 0},
    "threshold above 1": {"threshold": 1.5, "method": "antidiagonal"},
    "estimate_every 0": {"estimate_every": 0},
    "samples 0": {"samples": 0},
    "method unknown": {"method": "x"},
    "method a list": {"method": ["sampled"]},
    "method None": {"method": None},
    "forced_blocks None": {"forced_blocks": None},
    "keep_sink 1": {"keep_sink": 1},
    "causal None": {"causal": None},
    "pooled method on top": {"method": "sampled_head", "forced_blocks": "on_top"},
}


@pytest.mark.parametrize("case", sorted(WRONG_CONFIGS))
def test_wrong_config_values_are_refused_when_made(case: str) -> None:
    with pytest.raises((ValueError, TypeError)) as error:
        BlockSparseConfig(**WRONG_CONFIGS[case])
    assert "unhashable" not in str(error.value)  # says what is wrong, not how it broke
