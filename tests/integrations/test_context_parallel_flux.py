"""FLUX patched under diffusers' context parallelism (Ulysses, 2 CPU ranks, gloo).

ditops' FLUX attention processor hands diffusers' parallel config and attention backend
through to the processor it wraps (``dispatch_attention_fn(..., parallel_config=...)``), and
the fused adaLN chain and prologue work token by token, so an exact patch under Ulysses
is bitwise the unpatched model under Ulysses, in both orders (patch then
``enable_parallelism``, and the other way round), and as close to one process as the
unpatched model is (its matmuls see other shapes per rank, so not bitwise). Without the
hand-through each rank would attend within its own shard: off by about 3e-2, without an
error.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from diffusers import ContextParallelConfig, FluxTransformer2DModel
from torch import nn

import ditops
from tests.integrations.process_group import run_group
from tests.integrations.test_diffusers_flux import TINY

pytestmark = pytest.mark.slow

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: the unpatched model under Ulysses against one process (other matmul shapes per rank)
TOL = {"fp32": 1e-5, "bf16": 3e-2}


def model_of(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return FluxTransformer2DModel(**TINY).to(dtype).eval()


def inputs(dtype: torch.dtype, side: int = 6, text: int = 8) -> dict[str, torch.Tensor]:
    # diffusers' split needs lengths the ranks divide: 36 image and 8 text tokens on 2
    g = torch.Generator().manual_seed(1)
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3).float()
    return {
        "hidden_states": torch.randn(1, side * side, 8, generator=g).to(dtype) * 2,
        "encoder_hidden_states": torch.randn(1, text, 24, generator=g).to(dtype),
        "pooled_projections": torch.randn(1, 12, generator=g).to(dtype),
        "timestep": torch.tensor([0.7], dtype=dtype),
        "img_ids": img_ids,
        "txt_ids": torch.zeros(text, 3),
    }


def forward(model: nn.Module, x: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.inference_mode():
        return model(**x, return_dict=False)[0]


def diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float("inf") if a.shape != b.shape else float((a.double() - b.double()).abs().max())


def test_flux_exact_patch_under_ulysses_is_bitwise_one_process() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # each rank runs one thread; kernels round by thread count
    try:
        refs = {name: forward(model_of(dtype), inputs(dtype)) for name, dtype in DTYPES.items()}
    finally:
        torch.set_num_threads(threads)

    def checks(rank: int, world: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, dtype in DTYPES.items():
            x = inputs(dtype)
            config = ContextParallelConfig(ulysses_degree=world)
            plain = model_of(dtype)
            plain.enable_parallelism(config=config)
            parallel = forward(plain, x)
            out[f"one process {name}"] = diff(parallel, refs[name])
            first = model_of(dtype)
            ditops.patch(first, precision="exact")
            first.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
            out[f"patch-enable {name}"] = diff(forward(first, x), parallel)
            second = model_of(dtype)
            second.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
            report = ditops.patch(second, precision="exact")
            out[f"prologues {name}"] = report.models["FluxTransformer2DModel"].get(
                "fused attention prologues", 0
            )
            out[f"enable-patch {name}"] = diff(forward(second, x), parallel)
        return out

    for rank, got in enumerate(run_group(checks, 2)):
        for key, value in got.items():
            if key.startswith("prologues"):
                assert value == 4, (rank, key, value)
            elif key.startswith("one process"):
                assert value <= TOL[key.split()[-1]], (rank, key, value)
            else:
                assert value == 0.0, (rank, key, value)
