"""What a patched model of any declared family must survive, as checks a family's test
calls with its tiny model, inputs and ``run(model, **inputs)``: a changed diffusers
function refused, deep copies, pickling and patching again, torch.compile."""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import ditops

Run = Callable[..., torch.Tensor]


def change_source(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> None:
    """Replace ``owner.<name>`` by a wrapper calling it: the same arithmetic, another
    source, so another fingerprint (a diffusers version ditops does not know)."""
    original = getattr(owner, name)

    def changed(*args, **kwargs):
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, changed)


def check_deep_copy(model: nn.Module, x: dict, run: Run, change: Callable[[Any], None]) -> None:
    """An exact-patched model's deep copy runs its own weights (``change(copy)`` alters
    them), the original is untouched, and the copy unpatches to the same bits."""
    ditops.patch(model, precision="exact")
    before = run(model, **x)
    twin = copy.deepcopy(model)
    assert torch.equal(run(twin, **x), before)
    with torch.no_grad():
        change(twin)
    changed = run(twin, **x)
    assert not torch.equal(changed, before)  # the copy runs its own weights
    assert torch.equal(run(model, **x), before)
    ditops.unpatch(twin)
    assert torch.equal(run(twin, **x), changed)  # exact: unpatched, the same bits
    assert hasattr(model, "_ditops_patch")


def check_pickles_and_patches_again(model: nn.Module, x: dict, run: Run) -> None:
    """A fast-patched model saved and loaded runs the same; patched again in exact
    precision it is bitwise the unpatched model; unpatched, too."""
    ref = run(model, **x)
    ditops.patch(model, precision="fast")
    fast = run(model, **x)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert torch.equal(run(loaded, **x), fast)
    assert pickle.loads(pickle.dumps(model))._ditops_patch.options == model._ditops_patch.options
    ditops.patch(loaded, precision="exact")
    assert torch.equal(run(loaded, **x), ref)
    ditops.unpatch(loaded)
    assert not hasattr(loaded, "_ditops_patch")
    assert torch.equal(run(loaded, **x), ref)


def check_compile_fullgraph(build: Callable[[], nn.Module], x: dict, run: Run) -> None:
    """The exact-patched model compiled before any eager call, fullgraph (aot_eager:
    dynamo and AOT tracing through the ops' fake implementations), no recompile on the
    second call, bitwise the unpatched model."""
    torch._dynamo.reset()
    ref = run(build(), **x)
    model = build()
    ditops.patch(model, precision="exact")
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            first = run(compiled, **x)
            again = run(compiled, **x)
    finally:
        torch._dynamo.reset()
    assert torch.equal(first, again)
    assert torch.equal(first, ref)


def check_offload(
    build: Callable[[], nn.Module], x: dict, run: Run, mode: str, order: str, tmp: Any
) -> dict[str, str]:
    """The exact-patched model under an offload mode of tests/integrations/test_offload.py
    (applied before or after the patch: ``order``) is bitwise the unpatched model under
    the same offload; returns ``explain_patch``'s places for the caller to check."""
    from tests.integrations.test_offload import MODES

    apply = MODES[mode][0]
    plain = build()
    apply(plain, tmp / "a")
    want = run(plain, **x)
    model = build()
    if order == "offload-first":
        apply(model, tmp / "b")
    ditops.patch(model, precision="exact")
    if order == "patch-first":
        apply(model, tmp / "b")
    assert torch.equal(run(model, **x), want)
    return ditops.explain_patch(model)[type(model).__name__]


def check_triton_paths(
    monkeypatch: pytest.MonkeyPatch, model: nn.Module, x: dict, run: Run, ops: tuple, tol: float
) -> dict[str, int]:
    """The fast-patched model with every op of ``ops`` (classes) on its Triton path (CPU
    tensors through Triton's interpreter, dispatched as CUDA; strict: a fall back would
    raise) within ``tol`` of the unpatched model; returns the calls per op."""
    from ditops import config
    from ditops.custom_op import reset_state
    from tests.integrations.spies import install_spies
    from tests.precision import max_rel_err

    ref = run(model, **x)
    ditops.patch(model, precision="fast")
    reset_state()
    try:
        with ditops.force_device_kind({"cpu": "cuda"}), config.override(strict=True):
            used = install_spies(monkeypatch, ops, "forward_cuda")
            out = run(model, **x)
    finally:
        reset_state()
    assert max_rel_err(out, ref) <= tol
    return used
