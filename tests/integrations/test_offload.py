"""ditops.patch with diffusers' and accelerate's offloading, in both orders, on Wan and FLUX.

The rule (README, "What others attach"): a fused forward runs only while nothing is
attached to the modules it computes without calling; otherwise that block runs diffusers'
own forward, which calls every module through its hooks. So under every offload mode the
patched model in exact precision is bitwise the unpatched model under the same offload,
and the fusion kept is what the mode allows (block-level and model offload hook whole
blocks: all fused; leaf-level and sequential offload hook every leaf: none fused).

On this CPU-only machine offloading moves nothing between devices, but its hooks do
everything else as on a GPU: sequential offload keeps every parameter on ``meta`` between
calls, disk offload writes and reads the weights, leaf-level hooks onload each module
(streams need CUDA and are not run here). Before the rule, leaf-level offload gave NaN
or garbage and sequential offload crashed (``q_weight is on meta``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import ditops
from ditops.attention.schedule import BlockSparseConfig
from tests.integrations import test_diffusers_flux as flux_t
from tests.integrations import test_diffusers_wan as wan_t

accelerate = pytest.importorskip("accelerate", reason="accelerate is part of the test install")

SPARSE = BlockSparseConfig(sparsity=0.5, block_size=32, stride=4)


def _model_offload(model: nn.Module, tmp: Path) -> None:
    # What enable_model_cpu_offload installs on each model (execution device: the CPU here).
    accelerate.cpu_offload_with_hook(model, execution_device="cpu")


def _sequential(model: nn.Module, tmp: Path) -> None:
    # What enable_sequential_cpu_offload installs: parameters on meta between calls.
    accelerate.cpu_offload(model, execution_device=torch.device("cpu"))


def _group(offload_type: str, disk: bool = False) -> Callable[[nn.Module, Path], None]:
    def apply(model: nn.Module, tmp: Path) -> None:
        kw: dict = {"num_blocks_per_group": 1} if offload_type == "block_level" else {}
        if disk:
            kw["offload_to_disk_path"] = str(tmp)
        model.enable_group_offload(
            onload_device=torch.device("cpu"),
            offload_device=torch.device("cpu"),
            offload_type=offload_type,
            **kw,
        )

    return apply


#: mode -> (how to apply it, the families whose blocks stay fused under it). Sequential
#: and leaf-level offload hook the modules that hold parameters: Wan's norm2 has a weight
#: (its blocks run unfused), the norms FLUX's fused blocks bypass have none (they stay
#: fused: what they call, the linear layers, onload through their own hooks).
MODES: dict[str, tuple[Callable[[nn.Module, Path], None], set[str]]] = {
    "model": (_model_offload, {"wan", "flux"}),
    "sequential": (_sequential, {"flux"}),
    "group-block": (_group("block_level"), {"wan", "flux"}),
    "group-block-disk": (_group("block_level", disk=True), {"wan", "flux"}),
    "group-leaf": (_group("leaf_level"), {"flux"}),
    "group-leaf-disk": (_group("leaf_level", disk=True), {"flux"}),
}


def _wan() -> tuple[nn.Module, dict]:
    return wan_t.tiny_wan(keep_fp32=True), wan_t.inputs(frames=4, hw=16)


def _flux() -> tuple[nn.Module, dict]:
    return flux_t.tiny_flux(), flux_t.inputs()


def _run(model: nn.Module, x: dict, steps: int = 1) -> list[torch.Tensor]:
    outs = []
    with torch.inference_mode():
        for step in range(steps):
            with model.cache_context("cond", step_index=step):
                outs.append(model(**x, return_dict=False)[0].clone())
    return outs


def _patch(model: nn.Module, family: str, variant: str) -> None:
    if variant == "sparse":  # dense step 0, sparse step 1 (exact norms throughout)
        ditops.patch(
            model,
            precision="exact",
            attention=BlockSparseConfig(sparsity=0.5, block_size=32, stride=4, skip_first_steps=1),
        )
    else:
        ditops.patch(model, precision="exact")


CASES = [
    (mode, order, family, variant)
    for mode in MODES
    for order in ("offload-first", "patch-first")
    for family in ("wan", "flux")
    for variant in ("exact", "sparse")
    if not (family == "flux" and variant == "sparse")  # FLUX has no sparse attention
]


@pytest.mark.parametrize(("mode", "order", "family", "variant"), CASES)
def test_offload_gives_the_unpatched_model_under_the_same_offload(
    mode: str, order: str, family: str, variant: str, tmp_path: Path
) -> None:
    build = _wan if family == "wan" else _flux
    apply, fused_families = MODES[mode]
    steps = 2 if variant == "sparse" else 1
    # The reference: the same weights, unpatched (dense) or patched without offload (sparse).
    reference, x = build()
    if variant == "sparse":
        _patch(reference, family, variant)
    want = _run(reference, x, steps)

    model, _ = build()
    if order == "offload-first":
        apply(model, tmp_path / "a")
        _patch(model, family, variant)
    else:
        _patch(model, family, variant)
        apply(model, tmp_path / "a")
    got = _run(model, x, steps)
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        assert torch.equal(g, w), f"max abs diff {(g.float() - w.float()).abs().max():.3g}"

    places = ditops.explain_patch(model)[type(model).__name__]
    blocks = {k: v for k, v in places.items() if "blocks." in k}
    assert blocks, places
    fused = [k for k, v in blocks.items() if v == "fused"]
    if family in fused_families:
        assert len(fused) == len(blocks), places
    else:
        assert not fused, places
        assert all("hook" in why for why in blocks.values()), places
