"""A model with nothing to patch is refused, changing nothing; a pipeline lists its
components with nothing to patch (ditops.integrations.patching)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ditops
from ditops.integrations.shared.base import PatchError


class NoNorms(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = nn.GroupNorm(2, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x).unsqueeze(-1)).squeeze(-1)


class WithNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


class Pipe:
    def __init__(self, **components: nn.Module) -> None:
        self.components = components


def _unet() -> nn.Module:
    diffusers = pytest.importorskip("diffusers")
    return diffusers.UNet2DModel(
        sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
        block_out_channels=(8, 16), down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"), norm_num_groups=4,
    )  # fmt: skip


@pytest.mark.parametrize("make", [_unet, NoNorms])
def test_a_single_model_with_nothing_to_patch_is_refused_changing_nothing(make) -> None:
    model = make()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    classes = [type(m) for m in model.modules()]
    with pytest.raises(PatchError, match="nothing to patch") as info:
        ditops.patch(model)
    text = str(info.value)
    assert type(model).__name__ in text and "WanTransformer3DModel" in text and "LayerNorm" in text
    assert "_ditops_patch" not in vars(model)
    assert [type(m) for m in model.modules()] == classes
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert ditops.patch(model, norms=False).models == {type(model).__name__: {}}  # none asked


def test_a_pipeline_lists_its_components_with_nothing_to_patch(ditops_warnings) -> None:
    pipe = Pipe(transformer=WithNorm(), transformer_2=NoNorms())
    report = ditops.patch(pipe)
    assert report.models["transformer"] == {"norms": 1}
    assert "transformer_2" in report.nothing and "LayerNorm" in report.nothing["transformer_2"]
    assert "transformer_2: nothing to patch" in str(report)
    assert any("transformer_2" in m and "nothing to patch" in m for m in ditops_warnings())
    ditops.unpatch(pipe)
    assert type(pipe.components["transformer"].norm) is nn.LayerNorm


def test_a_pipeline_with_nothing_to_patch_anywhere_is_refused() -> None:
    pipe = Pipe(transformer=NoNorms(), transformer_2=NoNorms())
    with pytest.raises(PatchError, match="nothing to patch"):
        ditops.patch(pipe)
    assert all("_ditops_patch" not in vars(m) for m in pipe.components.values())
