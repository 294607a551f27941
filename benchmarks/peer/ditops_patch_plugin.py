"""pytest plugin: every Wan / FLUX transformer diffusers' tests build is ditops-patched
(exact precision) as soon as it is constructed."""

import functools
import os

from diffusers import FluxTransformer2DModel, WanTransformer3DModel

import ditops

PRECISION = os.environ.get("DITOPS_PEER_PRECISION", "exact")
SPARSE = os.environ.get("DITOPS_PEER_SPARSE")


def _wrap(cls):
    original = cls.__init__

    @functools.wraps(original)
    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if type(self) is cls:
            opts = {"precision": PRECISION}
            if SPARSE and cls is WanTransformer3DModel:
                opts["attention"] = ditops.BlockSparseConfig(
                    sparsity=float(SPARSE), block_size=16, stride=4
                )
            ditops.patch(self, **opts)

    cls.__init__ = init


for c in (WanTransformer3DModel, FluxTransformer2DModel):
    _wrap(c)

PATCHED = {"n": 0}
_patch = ditops.patch


def _counting_patch(*a, **k):
    PATCHED["n"] += 1
    return _patch(*a, **k)


ditops.patch = _counting_patch


def pytest_sessionfinish(session, exitstatus):
    print(f"\nditops peer check: {PATCHED['n']} models patched")
