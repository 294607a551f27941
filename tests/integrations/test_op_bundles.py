"""Each family's op bundle is a declared dataclass: every op a fused forward takes from it
is a typed field (a reader and a type checker follow ``ops.qk`` to its op class), made
with the precision asked."""

from __future__ import annotations

import copy
import dataclasses
import pickle
import typing

import pytest

from ditops.core.op import CustomOp
from ditops.integrations.patching import FAMILIES
from ditops.integrations.shared.family import DeclaredFamily
from ditops.integrations.shared.ops import Ops

DECLARED = [f for f in FAMILIES if isinstance(f, DeclaredFamily)]


@pytest.mark.parametrize("family", DECLARED, ids=lambda f: f.name)
@pytest.mark.parametrize("precision", ["exact", "fast", None])
def test_the_bundle_declares_each_op_as_a_typed_field(family, precision) -> None:
    bundle = family.spec.ops(precision)
    assert isinstance(bundle, Ops) and dataclasses.is_dataclass(bundle)
    types = typing.get_type_hints(type(bundle))
    fields = [f.name for f in dataclasses.fields(bundle) if f.name != "precision"]
    assert fields, f"{family.name}: an empty bundle"
    for name in fields:
        op = getattr(bundle, name)
        assert isinstance(types[name], type) and issubclass(types[name], CustomOp), name
        assert type(op) is types[name], (family.name, name, type(op), types[name])
        assert op.precision == precision
    again = pickle.loads(pickle.dumps(bundle))
    assert [getattr(again, n).precision for n in fields] == [precision] * len(fields)
    copied = copy.deepcopy(bundle)
    assert all(getattr(copied, n) is not getattr(bundle, n) for n in fields)
