"""Under ``torch.compile(fullgraph=True)`` nothing of ditops' dispatch is left in the
graph (issue 39, item 2): the choice is made at trace time, so the graph of a patched
Wan model holds the chosen paths' kernels (one opaque node each) and the model's own
torch calls, and none of the per-call work (argument checks, the plan, the tuner, the
CPU NaN/inf check for ops whose paths need none) nor any ditops Python function."""

from __future__ import annotations

import operator

import pytest
import torch

import ditops
from tests.integrations.test_diffusers_wan import inputs, run, tiny_wan

#: What the dispatch itself would put in a graph if it were traced into it: the CPU
#: non-finite check (``finite``: aminmax, isfinite, stack, all; ``torch.cond``), a host
#: read of a value (``item``) or a Python-level size read turned into a node.
DISPATCH_NODES = {"aminmax", "isfinite", "stack", "all", "cond", "item", "numel"}


def _name(target: object) -> str:
    if isinstance(target, str):
        return target
    return getattr(target, "__name__", str(target)).split(".")[-1]


@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_a_patched_models_graph_holds_only_the_chosen_paths(precision: str) -> None:
    graphs: list[torch.fx.GraphModule] = []

    def capture(gm: torch.fx.GraphModule, _inputs: list[torch.Tensor]) -> object:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    x = inputs(frames=4, hw=16)
    model = tiny_wan(keep_fp32=True)
    ditops.patch(model, precision=precision)
    compiled = torch.compile(model, fullgraph=True, backend=capture)
    with torch.inference_mode():
        run(compiled, step=0, **x)
    assert len(graphs) == 1
    kernels, foreign, dispatch = set(), [], []
    for node in graphs[0].graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            if target.namespace == "ditops":
                kernels.add(target.name())
            continue
        module = getattr(target, "__module__", None) or ""
        if node.op == "call_function" and not (
            module.startswith("torch") or target in vars(operator).values()
        ):
            foreign.append(f"{module}.{_name(target)}")
        if _name(target) in DISPATCH_NODES:
            dispatch.append(_name(target))
    # the chosen CPU paths, each one opaque node
    assert kernels == {
        "ditops::cpu_fp32_layer_norm",
        "ditops::cpu_gated_residual",
        "ditops::cpu_layer_norm_scale_shift",
        "ditops::cpu_qk_norm_rope",
        "ditops::cpu_scale_residual_layer_norm_scale_shift",
    }
    assert foreign == []  # no ditops function (the dispatch, a check) kept as a node
    assert dispatch == []
    torch._dynamo.reset()
