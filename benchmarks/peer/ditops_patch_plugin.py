"""pytest plugin: every diffusers model of a family ditops patches deep (the classes each
family in ``ditops.integrations.patching.FAMILIES`` declares) is ditops-patched (exact
precision; ``DITOPS_PEER_SPARSE=0.5`` adds sparse attention where the family serves it)
as soon as diffusers' tests construct it."""

import functools
import os

import diffusers

import ditops
from ditops.integrations.patching import FAMILIES

PRECISION = os.environ.get("DITOPS_PEER_PRECISION", "exact")
SPARSE = os.environ.get("DITOPS_PEER_SPARSE")
PATCHED: dict[str, int] = {}


def _wrap(cls: type, sparse: bool) -> None:
    original = cls.__init__

    @functools.wraps(original)
    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if type(self) is cls:
            opts = {"precision": PRECISION}
            if SPARSE and sparse:
                opts["attention"] = ditops.BlockSparseConfig(
                    sparsity=float(SPARSE), block_size=16, stride=4
                )
            ditops.patch(self, **opts)
            PATCHED[cls.__name__] = PATCHED.get(cls.__name__, 0) + 1

    cls.__init__ = init


for family in FAMILIES:
    for name in family.model_classes:
        cls = getattr(diffusers, name, None)
        if isinstance(cls, type):
            _wrap(cls, family.sparse_attention)


def pytest_sessionfinish(session, exitstatus):
    done = ", ".join(f"{n} {name}" for name, n in sorted(PATCHED.items())) or "none"
    print(f"\nditops peer check: models patched: {done}")
