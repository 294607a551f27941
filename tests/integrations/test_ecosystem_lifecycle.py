"""What users do with a patched model besides combining it (tests/integrations/
test_ecosystem.py): patching again and pipelines refused as a whole, unpatching a model
changed since the patch, compiling it, the precision in force, threads sharing it. Each
test is one finding of the ecosystem issue; each failed on the code before it."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

import ditops
from ditops.attention.schedule import BlockSparseConfig
from ditops.integrations import PatchError
from tests.integrations import test_diffusers_wan as wan_t
from tests.integrations.test_ecosystem import SPARSE, flux, run, wan

# --- transactions -------------------------------------------------------------------------------


def test_a_refused_repatch_leaves_the_model_patched_as_it_was() -> None:
    model, x = flux()
    ditops.patch(model, precision="exact")
    record = model._ditops_patch
    forwards = [vars(b).get("forward") for b in model.transformer_blocks]
    want = run(model, x)
    with pytest.raises(PatchError, match="sparse attention"):
        ditops.patch(model, attention=BlockSparseConfig(sparsity=0.5))
    assert model._ditops_patch is record and record.options.precision == "exact"
    assert [vars(b).get("forward") for b in model.transformer_blocks] == forwards
    assert torch.equal(run(model, x), want)


def test_a_pipeline_refused_for_one_model_changes_none() -> None:
    class Pipe:
        def __init__(self) -> None:
            self.components = {"transformer": wan()[0], "transformer_2": flux()[0]}

    pipe = Pipe()
    with pytest.raises(PatchError):
        ditops.patch(pipe, attention=SPARSE)
    for m in pipe.components.values():
        assert not hasattr(m, "_ditops_patch")
        assert all("forward" not in vars(b) for b in m.modules())
    ditops.patch(pipe.components["transformer"], precision="exact")
    with pytest.raises(PatchError):
        ditops.patch(pipe, precision="fast", attention=SPARSE)
    assert pipe.components["transformer"]._ditops_patch.options.precision == "exact"


# --- unpatch restores the model as it is now ----------------------------------------------------


def test_unpatch_after_load_state_dict_assign_keeps_the_new_parameters() -> None:
    model, x = wan()
    other, _ = wan()
    for p in other.parameters():
        p.data.normal_(0, 0.1)
    want = run(other, x)
    ditops.patch(model, precision="exact")
    model.load_state_dict(other.state_dict(), assign=True)
    assert torch.equal(run(model, x), want)
    ditops.unpatch(model)
    assert torch.equal(run(model, x), want)


def test_meta_init_patch_to_empty_load_unpatch() -> None:
    source, x = wan()
    want = run(source, x)
    with torch.device("meta"):
        model = wan_t.WanTransformer3DModel(**wan_t.TINY).eval()
    model = wan_t.cast_like_from_pretrained(model, torch.bfloat16)
    ditops.patch(model, precision="exact")
    model.to_empty(device="cpu")
    model.load_state_dict(source.state_dict())
    for name, buffer in source.named_buffers():  # rope tables: not in the state dict
        model.get_buffer(name).copy_(buffer)
    assert torch.equal(run(model, x), want)
    ditops.unpatch(model)  # "Tensor on device meta" before the fix
    assert torch.equal(run(model, x), want)


def test_unpatch_keeps_the_processors_the_user_set_after_the_patch() -> None:
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    model, x = wan()
    ditops.patch(model, precision="exact", attention=SPARSE)
    mine = {n: WanAttnProcessor() for n in model.attn_processors}
    model.set_attn_processor(dict(mine))
    ditops.unpatch(model)
    assert all(model.attn_processors[n] is p for n, p in mine.items())


# --- compiled models ---------------------------------------------------------------------------


@pytest.mark.slow
def test_patch_reaches_through_torch_compile() -> None:
    # aot_eager: the graph dynamo traces, run by eager kernels, so bitwise comparable.
    model, x = wan()
    want = run(model, x)
    compiled = torch.compile(model, backend="aot_eager")
    run(compiled, x)  # compiled and run before the patch
    report = ditops.patch(compiled, precision="exact", attention=SPARSE)
    summary = report.models["WanTransformer3DModel"]
    assert summary["fused blocks"] == 2 and summary["sparse self-attentions"] == 2
    assert model._ditops_patch.family == "wan"
    assert torch.equal(run(compiled, x), want)  # step 0: dense, exact
    eager = copy.deepcopy(model)
    assert torch.equal(run(compiled, x, step=1), run(eager, x, step=1))

    class Pipe:
        components = {"transformer": torch.compile(wan()[0], backend="aot_eager")}

    assert ditops.patch(Pipe(), precision="exact").models["transformer"]["fused blocks"] == 2


# --- the precision in force --------------------------------------------------------------------


class Generic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(64, 64)
        self.norm = nn.LayerNorm(64)
        nn.init.normal_(self.norm.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x))


def test_exact_from_the_settings_keeps_generic_models_bitwise() -> None:
    model = Generic().bfloat16()
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(2)).bfloat16() * 4
    with torch.inference_mode():
        want = model(x)
        ditops.patch(model)  # precision=None: follows the settings per call
        with ditops.override(precision="exact"):
            assert torch.equal(model(x), want)
        with ditops.override(precision="fast"):
            fast = model(x)
    assert not torch.equal(fast, want)  # fast: fp32 inside, a few ulps apart
    torch.testing.assert_close(fast, want, atol=0.05, rtol=0.02)


# --- threads ------------------------------------------------------------------------------------


def test_threads_sharing_a_patched_model_each_get_their_own_step() -> None:
    model, x = wan()
    ditops.patch(model, precision="exact", attention=BlockSparseConfig(
        sparsity=0.5, block_size=32, stride=4, skip_first_steps=5, estimate_every=2))  # fmt: skip
    want = {s: run(model, x, step=s) for s in (0, 7)}
    barrier = threading.Barrier(2)
    got: dict[int, list[torch.Tensor]] = {0: [], 7: []}
    errors: list[BaseException] = []

    def worker(step: int) -> None:
        try:
            for _ in range(3):
                with torch.inference_mode(), model.cache_context("cond", step_index=step):
                    barrier.wait(timeout=30)  # both threads inside their contexts at once
                    got[step].append(model(**x, return_dict=False)[0].clone())
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in (0, 7)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for step in (0, 7):
        assert all(torch.equal(g, want[step]) for g in got[step]), step
