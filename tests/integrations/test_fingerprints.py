"""Edited copies of diffusers' functions against the fingerprint of what they compute
(:mod:`ditops.integrations.shared.fingerprints`): a comment, a docstring, formatting, an
annotation, a renamed local or an edit inside a branch this process never takes changes
nothing; an eps, a sign, an order of operations, a renamed parameter or a probe that is
not diffusers' own changes the fingerprint, and a model relying on the copy is refused
naming the function (nothing changed), or served bitwise."""

from __future__ import annotations

import inspect
import itertools
import linecache
import textwrap
from collections.abc import Callable
from typing import Any

import pytest
import torch
from diffusers.models import normalization
from diffusers.models.transformers import transformer_wan as tw

import ditops
from ditops.integrations import PatchError
from ditops.integrations.shared.fingerprints import fingerprint, known, match
from tests.integrations import test_diffusers_hunyuan_video as hv_t
from tests.integrations import test_diffusers_wan as wan_t

_COUNT = itertools.count()


def edited(fn: Callable[..., Any], old: str, new: str, **globals_: Any) -> Callable[..., Any]:
    """A copy of ``fn`` with ``old`` replaced by ``new`` in its source, compiled in its
    module's globals (plus ``globals_``), its source readable as diffusers' is."""
    src = textwrap.dedent(inspect.getsource(fn))
    assert old in src, old
    src = src.replace(old, new)
    name = f"<edited diffusers {next(_COUNT)}>"
    linecache.cache[name] = (len(src), None, src.splitlines(True), name)
    namespace: dict[str, Any] = {}
    exec(compile(src, name, "exec"), {**fn.__globals__, **globals_}, namespace)
    return namespace[fn.__name__]


RMS = normalization.RMSNorm.forward
WAN = tw.WanTransformerBlock.forward

SAME = {
    "a comment": (RMS, "input_dtype = ", "# why not\n        input_dtype = "),
    "a docstring": (RMS, "-> torch.Tensor:\n", '-> torch.Tensor:\n    """Doc."""\n'),
    "formatting": (RMS, "mean(-1, keepdim=True)", "mean(\n  -1,\n  keepdim=True,\n )"),
    "an annotation": (RMS, "-> torch.Tensor:", "-> 'torch.Tensor | None':"),
    "a renamed local": (RMS, "variance", "var_fp32"),
    "the NPU branch on a CPU host": (RMS, "epsilon=self.eps)[0]", "epsilon=1e-3)[0] * 2"),
    "a block comment": (WAN, "# 2. Cross-attention", "# 2. Cross-attention (edited)"),
    "a block local renamed": (WAN, "ff_output", "mlp_out"),
}
DIFFERENT = {
    "an eps": (RMS, "variance + self.eps", "variance + 1e-5"),
    "a sign": (WAN, "(1 + scale_msa)", "(1 - scale_msa)"),
    "an order of operations": (
        WAN,
        "hidden_states.float() + ff_output.float() * c_gate_msa",
        "(hidden_states.float() + ff_output.float()) * c_gate_msa",
    ),
    "a cast moved": (RMS, "hidden_states.to(torch.float32).pow(2)", "hidden_states.pow(2)"),
    "a renamed parameter": (RMS, "hidden_states", "x"),
    "a local renamed to a global": (RMS, "input_dtype", "torch"),
}


@pytest.mark.parametrize("what", SAME)
def test_an_edit_that_computes_the_same_keeps_the_fingerprint(what: str) -> None:
    fn, old, new = SAME[what]
    label = "RMSNorm.forward" if fn is RMS else "WanTransformerBlock.forward"
    copy = edited(fn, old, new)
    assert fingerprint(copy) == fingerprint(fn) != "unavailable"
    assert match(copy, known(label)) is not None


@pytest.mark.parametrize("what", DIFFERENT)
def test_an_edit_of_the_arithmetic_changes_the_fingerprint(what: str) -> None:
    fn, old, new = DIFFERENT[what]
    label = "RMSNorm.forward" if fn is RMS else "WanTransformerBlock.forward"
    copy = edited(fn, old, new)
    assert fingerprint(copy) != fingerprint(fn)
    assert match(copy, known(label)) is None


def test_a_probe_that_is_not_diffusers_own_is_never_pruned() -> None:
    """The NPU branch is dropped only when the name is diffusers' probe and false here:
    a look-alike (here always true) keeps both branches, so an edit there is seen."""
    copy = edited(RMS, "epsilon=self.eps)[0]", "epsilon=1e-3)[0]",
                  is_torch_npu_available=lambda: True)  # fmt: skip
    assert fingerprint(copy) != fingerprint(RMS)
    assert fingerprint(RMS, prune=False) != fingerprint(RMS)


def test_unreadable_source_is_never_accepted() -> None:
    assert fingerprint(torch.add) == "unavailable"
    assert match(torch.add, known("RMSNorm.forward")) is None


def test_a_block_forward_with_comments_is_served_bitwise(monkeypatch: pytest.MonkeyPatch) -> None:
    model = wan_t.tiny_wan(keep_fp32=True)
    x = wan_t.inputs()
    ref = wan_t.run(model, **x)
    copy = edited(WAN, "# 1. Self-attention", "# 1. Self-attention, edited\n        # more")
    monkeypatch.setattr(tw.WanTransformerBlock, "forward", copy)
    assert torch.equal(wan_t.run(model, **x), ref)
    report = ditops.patch(model, precision="exact")
    assert report.models["WanTransformer3DModel"]["fused blocks"] == len(model.blocks)
    assert torch.equal(wan_t.run(model, **x), ref)
    assert ditops.explain_patch(model)["WanTransformer3DModel"][""].endswith("arithmetic of 0.42")


@pytest.mark.parametrize("what", ["a sign", "an order of operations"])
def test_a_block_forward_with_other_arithmetic_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch, what: str
) -> None:
    fn, old, new = DIFFERENT[what]
    monkeypatch.setattr(tw.WanTransformerBlock, "forward", edited(fn, old, new))
    model = wan_t.tiny_wan(keep_fp32=True)
    x = wan_t.inputs()
    ref = wan_t.run(model, **x)
    with pytest.raises(PatchError, match=r"blocks\[0\] is a WanTransformerBlock whose forward"):
        ditops.patch(model, precision="exact")
    assert not hasattr(model, "_ditops_patch")
    assert torch.equal(wan_t.run(model, **x), ref)


def test_an_rms_norm_with_another_eps_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fn, old, new = DIFFERENT["an eps"]
    monkeypatch.setattr(normalization.RMSNorm, "forward", edited(fn, old, new))
    model = hv_t.tiny_hunyuan()
    with pytest.raises(PatchError, match=r"RMSNorm.forward of diffusers .* differs"):
        ditops.patch(model, precision="exact")
    assert not hasattr(model, "_ditops_patch")


def test_relied_pairs_each_dotted_name_with_its_table_under_its_label() -> None:
    from diffusers.models.transformers import transformer_ltx

    from ditops.integrations.shared.fingerprints import known, relied

    got = relied(normalization, "RMSNorm.forward", "AdaLayerNorm.forward")
    assert list(got) == ["RMSNorm.forward", "AdaLayerNorm.forward"]
    assert got["RMSNorm.forward"] == (normalization.RMSNorm.forward, known("RMSNorm.forward"))
    label = "transformer_ltx.apply_rotary_emb"
    assert relied(transformer_ltx, "apply_rotary_emb", label="transformer_ltx.{}") == {
        label: (transformer_ltx.apply_rotary_emb, known(label))
    }
    # a module's dotted path is imported when asked (a family's relied_on stays lazy)
    assert relied("diffusers.models.normalization", "RMSNorm.forward") == {
        "RMSNorm.forward": (normalization.RMSNorm.forward, known("RMSNorm.forward"))
    }
    with pytest.raises(KeyError):  # a name the table does not hold is a mistake of ours
        relied(normalization, "RMSNorm.__init__")
