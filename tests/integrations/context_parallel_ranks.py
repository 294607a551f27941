"""The ranks' side of tests/integrations/test_context_parallel.py: tiny Wan models and
inputs, the one-process references, and the checks each rank of a process group runs
(returning plain numbers for the tests to assert)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from diffusers import (
    ChronoEditTransformer3DModel,
    ContextParallelConfig,
    ParallelConfig,
    WanTransformer3DModel,
)
from torch import nn

import ditops
from ditops.attention.schedule import BlockSparseConfig
from ditops.bench.wan_model import cast_like_from_pretrained
from ditops.custom_op import registered_ops
from ditops.integrations.shared.parallel import split_sizes
from tests.integrations.test_diffusers_wan import TINY

# 4 frames of 8 x 8 tokens = 256 tokens: 16 blocks of 16, the first frame 4 of them.
SPARSE = BlockSparseConfig(sparsity=0.5, skip_first_steps=1, block_size=16, stride=4, threshold=0.9)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: sparse steps against one process: the exchange moves data, the per-head work is the
#: same; fp32 as the issue asks, bf16 a few ulps of the output's scale (about 2).
TOL = {"fp32": 1e-5, "bf16": 2e-2}
#: 3 frames of 5 x 5 tokens: 75 tokens, odd, split 38 / 37 on 2 ranks.
ODD = {"frames": 3, "hw": 10}


def model_of(dtype: torch.dtype, heads: int = 2, path: str | None = None, **load: Any) -> nn.Module:
    if path is not None:
        return WanTransformer3DModel.from_pretrained(path, torch_dtype=dtype, **load).eval()
    torch.manual_seed(0)
    model = WanTransformer3DModel(**{**TINY, "num_attention_heads": heads}).eval()
    return cast_like_from_pretrained(model, dtype)  # as from_pretrained(torch_dtype=) loads


def chronoedit_of(dtype: torch.dtype) -> nn.Module:
    """ChronoEdit (Wan blocks, its own rotary embedding and processor copy, a _cp_plan)."""
    torch.manual_seed(0)
    model = ChronoEditTransformer3DModel(**TINY).eval()
    return cast_like_from_pretrained(model, dtype)


def inputs(dtype: torch.dtype, frames: int = 4, hw: int = 16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "hidden_states": torch.randn(1, 4, frames, hw, hw, generator=g).to(dtype),
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": torch.randn(1, 7, 16, generator=g).to(dtype),
    }


def per_token_inputs() -> dict[str, torch.Tensor]:
    x = inputs(torch.bfloat16)
    x["timestep"] = torch.randint(0, 1000, (1, 256), generator=torch.Generator().manual_seed(2))
    return x


def forward(model: nn.Module, step: int, x: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.inference_mode(), model.cache_context("cond", step_index=step):
        return model(**x, return_dict=False)[0]


@contextlib.contextmanager
def recorded_masks() -> Iterator[list[torch.Tensor]]:
    """Every block mask the estimate returns inside the block, in call order."""
    op = registered_ops()["estimate_block_mask"]
    original = op.forward
    masks: list[torch.Tensor] = []

    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        mask, counts = original(self, *args, **kwargs)
        masks.append(mask.clone())
        return mask, counts

    op.forward = spy
    try:
        yield masks
    finally:
        op.forward = original


def sparse_run(model: nn.Module, x: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Step 0 (dense) and step 1 (sparse) of a sparse-patched model, with its masks."""
    with recorded_masks() as masks:
        dense = forward(model, 0, x)
        assert not masks, "the dense step estimated a mask"
        sparse = forward(model, 1, x)
    return {"dense": dense, "sparse": sparse, "masks": masks}


def head_slice(heads: int, rank: int, world: int) -> slice:
    sizes = split_sizes(heads, world)
    return slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))


def diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float((a.double() - b.double()).abs().max())


def compare_sparse(got: dict[str, Any], want: dict[str, Any], heads: slice) -> dict[str, Any]:
    """Numbers the tests assert on: dense/sparse step differences, masks per rank's heads."""
    expected = [w[:, heads] for w in want["masks"]] if heads.stop > heads.start else []
    masks_equal = len(got["masks"]) == len(expected) and all(
        torch.equal(g, w) for g, w in zip(got["masks"], expected)
    )
    return {
        "dense": diff(got["dense"], want["dense"]),
        "sparse": diff(got["sparse"], want["sparse"]),
        "masks_equal": masks_equal,
        "mask_calls": len(got["masks"]),
        "local_heads": [int(m.shape[1]) for m in got["masks"]],
    }


def both_orders(
    dtype: torch.dtype, options: dict[str, Any], config: Any, measure: Any
) -> tuple[Any, Any, nn.Module]:
    """``measure`` a model patched then made parallel (``config()``), and one made parallel
    then patched; returns both measures and the second model."""
    first = model_of(dtype)
    ditops.patch(first, **options)
    first.enable_parallelism(config=config())
    patch_first = measure(first)
    second = model_of(dtype)
    second.enable_parallelism(config=config())
    ditops.patch(second, **options)
    return patch_first, measure(second), second


def error_of(fn: Any) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test asserts on the message
        return f"{type(exc).__name__}: {exc}"
    return ""


def one_process_references(refs: dict[str, Any]) -> None:
    with ditops.override(custom_ops="-block_sparse_attention"):
        for name, dtype in DTYPES.items():
            x = inputs(dtype)
            plain = model_of(dtype)
            refs[f"plain {name}"] = [forward(plain, s, x) for s in (0, 1)]
            ditops.patch(plain, precision="exact", attention=SPARSE)
            refs[f"sparse {name}"] = sparse_run(plain, x)
            chrono = chronoedit_of(dtype)
            refs[f"chronoedit plain {name}"] = forward(chrono, 1, x)
            ditops.patch(chrono, precision="exact", attention=SPARSE)
            refs[f"chronoedit sparse {name}"] = sparse_run(chrono, x)
        fp32 = torch.float32
        three = model_of(fp32, heads=3)
        ditops.patch(three, precision="exact", attention=SPARSE)
        refs["three heads"] = sparse_run(three, inputs(fp32))
        four = model_of(fp32, heads=4)
        ditops.patch(four, precision="exact", attention=SPARSE)
        refs["four heads"] = sparse_run(four, inputs(fp32))
        # A loaded model is its own reference: its weights are the built model's bit for
        # bit, but not 64-byte aligned (read from the file's mapping), which moves the
        # rounding of small matmuls by ~6e-7.
        loaded = model_of(fp32, path=refs["checkpoint"])
        ditops.patch(loaded, precision="exact", attention=SPARSE)
        refs["sparse loaded"] = sparse_run(loaded, inputs(fp32))
        # Wan2.2 TI2V: a timestep per token, which diffusers' plan splits with the sequence
        per_token = model_of(torch.bfloat16)
        refs["per token"] = forward(per_token, 1, per_token_inputs())


# --- the checks each rank runs ------------------------------------------------------------


def ulysses_checks(refs: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    mine = head_slice(2, rank, world)
    with ditops.override(custom_ops="-block_sparse_attention"):
        for name, dtype in DTYPES.items():
            x = inputs(dtype)
            plain_ref, sparse_ref = refs[f"plain {name}"], refs[f"sparse {name}"]

            def ulysses() -> Any:
                return ContextParallelConfig(ulysses_degree=world)

            m = model_of(dtype)
            m.enable_parallelism(config=ulysses())
            out[f"unpatched {name}"] = diff(forward(m, 1, x), plain_ref[1])

            def step_1(m: nn.Module, x: dict = x, want: torch.Tensor = plain_ref[1]) -> float:
                return diff(forward(m, 1, x), want)

            norms = both_orders(dtype, {"precision": "exact"}, ulysses, step_1)
            out[f"norms patch-enable {name}"], out[f"norms enable-patch {name}"], m = norms
            ditops.unpatch(m)
            out[f"norms unpatched {name}"] = step_1(m)

            def sparse(m: nn.Module, x: dict = x, want: dict = sparse_ref) -> dict[str, Any]:
                return compare_sparse(sparse_run(m, x), want, mine)

            runs = both_orders(dtype, {"precision": "exact", "attention": SPARSE}, ulysses, sparse)
            out[f"sparse patch-enable {name}"], out[f"sparse enable-patch {name}"], m = runs
            out["latent shape"] = list(m._ditops_steps.latent_shape)
            ditops.unpatch(m)
            out[f"sparse unpatched {name}"] = step_1(m)

            # ChronoEdit: diffusers gives it a _cp_plan (Wan's); both orders of patching
            chrono_ref = refs[f"chronoedit plain {name}"]
            c = chronoedit_of(dtype)
            c.enable_parallelism(config=ulysses())
            out[f"chronoedit unpatched {name}"] = diff(forward(c, 1, x), chrono_ref)
            c = chronoedit_of(dtype)
            ditops.patch(c, precision="exact")
            c.enable_parallelism(config=ulysses())
            out[f"chronoedit norms {name}"] = diff(forward(c, 1, x), chrono_ref)
            c = chronoedit_of(dtype)
            c.enable_parallelism(config=ulysses())
            ditops.patch(c, precision="exact", attention=SPARSE)
            out[f"chronoedit sparse {name}"] = compare_sparse(
                sparse_run(c, x), refs[f"chronoedit sparse {name}"], mine
            )

        fp32 = torch.float32
        x = inputs(fp32)
        m = model_of(
            fp32,
            path=refs["checkpoint"],
            # diffusers 0.42's from_pretrained takes a ParallelConfig here, not the CP config
            parallel_config=ParallelConfig(ContextParallelConfig(ulysses_degree=world)),
        )
        ditops.patch(m, precision="exact", attention=SPARSE)
        out["sparse from_pretrained-patch"] = compare_sparse(
            sparse_run(m, x), refs["sparse loaded"], mine
        )

        bf16 = model_of(torch.bfloat16)
        bf16.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
        ditops.patch(bf16, precision="exact")
        out["norms per token"] = diff(forward(bf16, 1, per_token_inputs()), refs["per token"])

        def with_grad() -> None:
            with torch.enable_grad(), m.cache_context("cond", step_index=1):
                m(**x, return_dict=False)

        out["grad refused"] = error_of(with_grad)

        # A layer-wide budget needs every head at once: refused (each rank has some).
        layer = model_of(fp32)
        layer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
        ditops.patch(layer, precision="exact", attention=dataclasses.replace(
            SPARSE, threshold=1.0, method="sampled_layer"))  # fmt: skip
        before = forward(layer, 0, x)  # dense step: no estimate, runs
        out["layer budget refused"] = error_of(lambda: forward(layer, 1, x))
        out["layer budget after refusal"] = diff(forward(layer, 0, x), before)  # unchanged

        # 3 heads: uneven only with ulysses_anything, as diffusers. (Uneven lengths: see
        # exchange_checks; diffusers' gather of uneven shards fails on gloo.)
        cfg = ContextParallelConfig(ulysses_degree=world, ulysses_anything=True)
        m = model_of(fp32, heads=3)
        ditops.patch(m, precision="exact", attention=SPARSE)
        m.enable_parallelism(config=cfg)
        out["anything"] = compare_sparse(
            sparse_run(m, x), refs["three heads"], head_slice(3, rank, world)
        )

        odd_x = inputs(fp32, **ODD)
        strict = ContextParallelConfig(ulysses_degree=world)
        for heads, what in ((3, "heads"), (2, "length")):
            xs = odd_x if what == "length" else x
            m = model_of(fp32, heads=heads)
            m.enable_parallelism(config=strict)
            out[f"uneven {what} unpatched"] = error_of(lambda m=m, xs=xs: forward(m, 1, xs))
            m = model_of(fp32, heads=heads)
            ditops.patch(m, precision="exact", attention=SPARSE)
            m.enable_parallelism(config=strict)
            out[f"uneven {what} patched"] = error_of(lambda m=m, xs=xs: forward(m, 1, xs))
    out.update(exchange_checks(rank, world))
    return out


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Dense attention in BSND."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2)


def exchange_checks(rank: int, world: int) -> dict[str, float]:
    """The exchange alone on uneven shards (75 tokens, 3 heads, batch 2), as an "anything"
    config splits them, against attention in one process."""
    from torch.distributed.device_mesh import init_device_mesh

    from ditops.integrations.shared.parallel import attend_across_ranks

    out = {}
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 75, 3, 16, generator=g) for _ in range(3))
    want = sdpa(q, k, v)
    mine = torch.arange(75).tensor_split(world)[rank]
    for mode in ("ulysses", "ring"):
        cp = ContextParallelConfig(**{f"{mode}_degree": world, f"{mode}_anything": True})
        mesh = init_device_mesh("cpu", cp.mesh_shape, mesh_dim_names=cp.mesh_dim_names)
        cp.setup(rank, world, torch.device("cpu"), mesh)
        got = attend_across_ranks(cp, q[:, mine], k[:, mine], v[:, mine], sdpa)
        out[f"exchange {mode} anything"] = diff(got, want[:, mine])
    return out


def ring_checks(refs: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    mine = head_slice(2, rank, world)
    with ditops.override(custom_ops="-block_sparse_attention"):
        for name, dtype in DTYPES.items():
            x = inputs(dtype)
            sparse_ref = refs[f"sparse {name}"]

            def ring() -> Any:
                return ContextParallelConfig(ring_degree=world)

            m = model_of(dtype)
            m.enable_parallelism(config=ring())
            out[f"unpatched {name}"] = error_of(lambda m=m, x=x: forward(m, 1, x))

            def sparse(m: nn.Module, x: dict = x, want: dict = sparse_ref) -> dict[str, Any]:
                return compare_sparse(sparse_run(m, x), want, mine)

            runs = both_orders(dtype, {"precision": "exact", "attention": SPARSE}, ring, sparse)
            out[f"sparse patch-enable {name}"], out[f"sparse enable-patch {name}"], m = runs
            ditops.unpatch(m)  # diffusers' own processors again: its Ring refusal is back
            out[f"sparse unpatched {name}"] = error_of(lambda m=m, x=x: forward(m, 1, x))

        fp32 = torch.float32
        m = model_of(fp32, heads=3)
        ditops.patch(m, precision="exact", attention=SPARSE)
        m.enable_parallelism(config=ContextParallelConfig(ring_degree=world))
        out["three heads"] = compare_sparse(
            sparse_run(m, inputs(fp32)), refs["three heads"], head_slice(3, rank, world)
        )
    return out


def unified_checks(refs: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    fp32 = torch.float32
    x = inputs(fp32)
    cfg = {"ring_degree": 2, "ulysses_degree": world // 2}
    with ditops.override(custom_ops="-block_sparse_attention"):
        m = model_of(fp32, heads=4)
        ditops.patch(m, precision="exact", attention=SPARSE)
        m.enable_parallelism(config=ContextParallelConfig(**cfg))
        out["sparse"] = compare_sparse(
            sparse_run(m, x), refs["four heads"], head_slice(4, rank, world)
        )
        m = model_of(fp32, heads=2)  # 2 heads on 4 ranks: two ranks hold none
        m.enable_parallelism(config=ContextParallelConfig(**cfg))
        ditops.patch(m, precision="exact", attention=SPARSE)
        out["fewer heads than ranks"] = compare_sparse(
            sparse_run(m, x), refs["sparse fp32"], head_slice(2, rank, world)
        )
    return out
