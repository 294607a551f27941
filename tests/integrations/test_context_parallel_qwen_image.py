"""Qwen-Image patched under diffusers' context parallelism (Ulysses, 2 CPU ranks, gloo).

Qwen-Image's plan splits the image and text tokens at the first block and the rotary
tables with them; ditops' processor hands diffusers' parallel config through to
``dispatch_attention_fn`` and the fused chain and prologue work token by token, so an
exact patch under Ulysses is bitwise the unpatched model under Ulysses, in both orders
(patch then ``enable_parallelism``, and the other way round), and as close to one process
as the unpatched model is (its matmuls see other shapes per rank, so not bitwise).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from diffusers import ContextParallelConfig

import ditops
from tests.integrations.process_group import run_group
from tests.integrations.spies import install_spies
from tests.integrations.test_context_parallel_flux import diff, forward
from tests.integrations.test_diffusers_qwen_image import inputs, tiny_qwen

pytestmark = pytest.mark.slow

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: the unpatched model under Ulysses against one process (other matmul shapes per rank)
TOL = {"fp32": 1e-5, "bf16": 3e-2}


def _inputs(dtype: torch.dtype) -> dict[str, Any]:
    # lengths the ranks divide: 30 image and 8 text tokens on 2
    x = inputs(dtype, batch=1, shapes=((1, 5, 6),), text=8)
    return {**x, "encoder_hidden_states_mask": None}


def test_qwen_image_exact_patch_under_ulysses_is_bitwise_one_process() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # each rank runs one thread; kernels round by thread count
    try:
        refs = {name: forward(tiny_qwen(dtype), _inputs(dtype)) for name, dtype in DTYPES.items()}
    finally:
        torch.set_num_threads(threads)

    def one_dtype(out: dict[str, Any], name: str, dtype: torch.dtype, world: int) -> None:
        x = _inputs(dtype)
        plain = tiny_qwen(dtype)
        plain.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
        parallel = forward(plain, x)
        out[f"one process {name}"] = diff(parallel, refs[name])
        first = tiny_qwen(dtype)
        ditops.patch(first, precision="exact")
        first.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
        out[f"patch-enable {name}"] = diff(forward(first, x), parallel)
        second = tiny_qwen(dtype)
        second.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
        report = ditops.patch(second, precision="exact")
        out[f"prologues {name}"] = report.models["QwenImageTransformer2DModel"].get(
            "fused attention prologues", 0
        )
        out[f"enable-patch {name}"] = diff(forward(second, x), parallel)

    def checks(rank: int, world: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        with pytest.MonkeyPatch.context() as mp:  # the fused prologue ran: its calls counted
            calls = install_spies(mp, [ditops.registered_ops()["qk_norm_rope"]])
            for name, dtype in DTYPES.items():
                one_dtype(out, name, dtype, world)
        out["qk_norm_rope calls"] = calls.get("qk_norm_rope", 0)
        return out

    for rank, got in enumerate(run_group(checks, 2)):
        for key, value in got.items():
            if key == "qk_norm_rope calls":  # 2 dtypes x 2 patched models x 2 blocks x 2
                assert value == 16, (rank, value)
            elif key.startswith("prologues"):
                assert value == 2, (rank, key, value)
            elif key.startswith("one process"):
                assert value <= TOL[key.split()[-1]], (rank, key, value)
            else:
                assert value == 0.0, (rank, key, value)
