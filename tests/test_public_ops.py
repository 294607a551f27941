"""Every public op is a function a person can read: ``inspect.signature``, ``help()`` and
the docstring show its parameters and meaning (issue 25, item 8)."""

from __future__ import annotations

import inspect
import pydoc

import pytest
import torch

import ditops
from ditops.core.op import CustomOp
from ditops.core.public import public_op
from ditops.ops.gelu import GeluTanhBiasOp

#: ditops' own ops (tests register toy ops of their own).
OPS = sorted(n for n, c in ditops.registered_ops().items() if c.__module__.startswith("ditops."))

#: What every public op's docstring states, by the words that head each part.
SECTIONS = ("Meaning", "Shapes", "Precision", "Paths")


def public(name: str):
    fn = getattr(ditops, name, None)
    assert fn is not None, f"registered op {name!r} has no public function ditops.{name}"
    return fn


@pytest.mark.parametrize("name", OPS)
def test_signature_is_the_ops_parameters(name: str) -> None:
    fn = public(name)
    assert inspect.isfunction(fn), f"ditops.{name} is a {type(fn).__name__}, not a function"
    params = inspect.signature(fn).parameters
    assert not any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params.values())
    prepared = inspect.signature(fn.op.prepare).parameters
    assert [(p.name, p.kind, p.default) for p in params.values()] == [
        (p.name, p.kind, p.default) for p in prepared.values()
    ]
    assert isinstance(fn.op, CustomOp) and fn.op.op_name == name
    assert inspect.signature(fn).return_annotation is not inspect.Signature.empty


@pytest.mark.parametrize("name", OPS)
def test_help_shows_parameters_and_meaning(name: str) -> None:
    fn = public(name)
    text = pydoc.render_doc(fn, renderer=pydoc.plaintext)
    assert f"{name}(" in text
    for param in inspect.signature(fn).parameters:
        assert param in text, f"help(ditops.{name}) does not show parameter {param!r}"
    doc = inspect.getdoc(fn) or ""
    for section in SECTIONS:
        assert f"{section}" in doc, f"ditops.{name}'s docstring has no {section!r} part"
    for spec in type(fn.op).declared_paths.values():  # the generated paths name every declared path
        assert spec.name in doc
    # Every parameter is described in the docstring, not only listed in the signature.
    for param in inspect.signature(fn).parameters:
        assert f"{param}" in doc.split("Paths (declared")[0], f"{name}: {param} undocumented"


def test_calling_the_function_runs_the_op_with_its_hooks() -> None:
    seen: list[tuple[int, ...]] = []
    handle = ditops.gelu_tanh_bias.op.register_forward_hook(
        lambda mod, args, out: seen.append(tuple(out.shape))
    )
    try:
        x = torch.randn(3, 8)
        out = ditops.gelu_tanh_bias(x, bias=torch.randn(8))
    finally:
        handle.remove()
    assert seen == [(3, 8)]
    assert out.shape == (3, 8)


def test_a_public_function_that_drifts_from_prepare_is_refused() -> None:
    with pytest.raises(TypeError, match="does not take the parameters"):

        @public_op(GeluTanhBiasOp())
        def gelu_tanh_bias(x: torch.Tensor, bias_: torch.Tensor | None = None) -> torch.Tensor:
            """Meaning: drifted."""

    with pytest.raises(TypeError, match="docstring"):

        @public_op(GeluTanhBiasOp())
        def gelu_tanh_bias2(x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
            pass


def test_bad_arguments_name_the_parameter() -> None:
    with pytest.raises(TypeError, match="bias_typo"):
        ditops.gelu_tanh_bias(torch.randn(2, 4), bias_typo=None)
