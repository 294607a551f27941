"""What is asked is what runs, or the user is told: every family counts its forced dense
part (Wan's first frame, HunyuanVideo-Framepack's text, history and first frame) in the
density asked; where that part alone is more, a warning says so and the density that ran
is read back per layer (ditops.sparse_densities)."""

from __future__ import annotations

import pytest
import torch

import ditops
from ditops.attention.schedule import BlockSparseConfig

pytest.importorskip("diffusers", reason="the diffusers extra is part of the test install")


def test_framepack_whose_forced_part_exceeds_the_density_warns_and_reports_it(
    ditops_warnings,
) -> None:
    from tests.integrations.test_diffusers_hunyuan_video_framepack import inputs, run, tiny

    model = tiny()
    x = inputs(batch=1, frames=3, hw=16)  # history and clean latents: 84 of 276 tokens
    cfg = BlockSparseConfig(sparsity=0.5, skip_first_steps=1, block_size=16)
    ditops.patch(model, precision="exact", attention=cfg)
    assert set(ditops.sparse_densities(model)[type(model).__name__].values()) == {None}
    run(model, "cond", **x)
    run(model, "cond", **{**x, "timestep": torch.tensor([400])})
    ran = ditops.sparse_densities(model)[type(model).__name__]
    assert len(ran) == 4 and all(d is not None for d in ran.values())
    densities = {round(d.block_density, 3) for d in ran.values() if d is not None}
    (warning,) = [m for m in ditops_warnings() if "forced" in m]
    assert "leading dense blocks" in warning and "0.500" in warning
    assert all(d > 0.5 and f"{d:.3f}" in warning for d in densities)


def test_wan_runs_the_density_asked_and_reports_it() -> None:
    from tests.integrations.test_diffusers_wan import inputs, run, tiny_wan

    model = tiny_wan(False)
    x = inputs(frames=8, hw=16)  # 512 tokens, 32 blocks: the first frame is 2 of them
    cfg = BlockSparseConfig(sparsity=0.5, block_size=16)
    ditops.patch(model, attention=cfg)
    run(model, **x)
    ran = ditops.sparse_densities(model)[type(model).__name__]
    assert ran and all(d is not None and abs(d.block_density - 0.5) <= 1 / 32 for d in ran.values())


def test_an_unpatched_model_has_no_sparse_layers() -> None:
    assert ditops.sparse_densities(torch.nn.Linear(2, 2)) == {"Linear": {}}


def _asked_or_told(model: torch.nn.Module, warnings: list[str], asked: float, blocks: int) -> int:
    """Every sparse layer ran the density asked (within a block row's share), or a warning
    gave the density that ran; returns how many layers ran sparse."""
    ran = [d for d in ditops.sparse_densities(model)[type(model).__name__].values() if d]
    for d in ran:
        told = any(f"density {d.block_density:.3f} ran" in m for m in warnings)
        assert abs(d.block_density - asked) <= 1 / blocks or told, (d.block_density, warnings)
    return len(ran)


@pytest.mark.parametrize("hw", [8, 32])
def test_hunyuan_video_runs_the_density_asked_or_says_what_ran(hw: int, ditops_warnings) -> None:
    from tests.integrations.test_diffusers_hunyuan_video import inputs, run, tiny_hunyuan

    model = tiny_hunyuan(torch.float32)
    ditops.patch(model, attention=BlockSparseConfig(sparsity=0.5, block_size=16))
    run(model, "cond", **inputs(torch.float32, frames=4, hw=hw))
    blocks = (4 * hw * hw // 4 + 7) // 16 + 1
    assert _asked_or_told(model, ditops_warnings(), 0.5, blocks) > 0


def test_mochi_runs_the_density_asked_or_says_what_ran(ditops_warnings) -> None:
    from tests.integrations.test_diffusers_mochi import inputs, run, tiny_mochi

    model = tiny_mochi(torch.float32)
    ditops.patch(model, attention=BlockSparseConfig(sparsity=0.5, block_size=4, stride=4))
    run(model, **inputs(torch.float32, batch=1))
    assert _asked_or_told(model, ditops_warnings(), 0.5, 8) > 0


def test_cogvideox_runs_the_density_asked_or_says_what_ran(ditops_warnings) -> None:
    from tests.integrations.test_diffusers_cogvideox import inputs, run, tiny_cogvideox

    model = tiny_cogvideox(torch.float32)
    ditops.patch(model, attention=BlockSparseConfig(sparsity=0.5, block_size=8))
    run(model, "cond", **inputs(model, frames=4, hw=16))
    assert _asked_or_told(model, ditops_warnings(), 0.5, 16) > 0


def test_hunyuan_video15_runs_the_density_asked_or_says_what_ran(ditops_warnings) -> None:
    from tests.integrations.test_diffusers_hunyuan_video15 import inputs, run, tiny_model

    model = tiny_model(torch.float32)
    ditops.patch(model, attention=BlockSparseConfig(sparsity=0.5, block_size=8))
    run(model, "cond", **inputs(torch.float32, frames=4, hw=16))
    assert _asked_or_told(model, ditops_warnings(), 0.5, 32) > 0


def test_ltx_video_runs_the_density_asked_or_says_what_ran(ditops_warnings) -> None:
    from tests.integrations.test_diffusers_ltx_video import inputs, run, tiny_ltx

    model = tiny_ltx(torch.float32)
    ditops.patch(model, attention=BlockSparseConfig(sparsity=0.5, block_size=8))
    run(model, 0, **inputs(torch.float32, frames=4, hw=8))
    assert _asked_or_told(model, ditops_warnings(), 0.5, 32) > 0
