"""The hidden set-up the docs' examples run under in the tests (``tests/test_doc_blocks.py``).

A page names a real checkpoint (``WanPipeline.from_pretrained("Wan-AI/...")``); the test
machine has no weights and no network. Here ``from_pretrained`` of a checkpoint the docs
name returns a tiny pipeline built from keyword arguments (:mod:`ditops.bench.tiny`:
random weights, the real arithmetic) whose call defaults are a tiny video; any other name
raises, so a page naming a new checkpoint fails until it gets a tiny stand-in here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ditops.bench.tiny import TINY_CALL, tiny_wan_pipeline


def _shrunk(pipe: Any) -> Any:
    """``pipe`` with the tiny video as its call's defaults (arguments given still win)."""
    base = type(pipe)

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        return base.__call__(self, *args, **{**TINY_CALL, **kwargs})

    pipe.__class__ = type(f"Tiny{base.__name__}", (base,), {"__call__": call})
    return pipe


def _wan(**kwargs: Any) -> Any:
    return _shrunk(tiny_wan_pipeline(kwargs.get("torch_dtype") or torch.float32))


#: checkpoint named in the docs -> (pipeline class name, tiny stand-in builder)
CHECKPOINTS: dict[str, tuple[str, Callable[..., Any]]] = {
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": ("WanPipeline", _wan),
}


@contextmanager
def tiny_checkpoints() -> Iterator[None]:
    """Within the block, ``<Pipeline>.from_pretrained(name, ...)`` builds the tiny stand-in."""
    import diffusers

    saved = {}
    for cls_name in {c for c, _ in CHECKPOINTS.values()}:
        cls = getattr(diffusers, cls_name)
        saved[cls_name] = cls.__dict__.get("from_pretrained")

        def stand_in(_cls: Any, name: str, *args: Any, _for: str = cls_name, **kw: Any) -> Any:
            wanted = CHECKPOINTS.get(name)
            if wanted is None or wanted[0] != _for:
                raise AssertionError(
                    f"a doc example loads {name!r} with {_for}: give it a tiny stand-in in "
                    "tests/doc_setup.py (CHECKPOINTS)"
                )
            return wanted[1](**kw)

        cls.from_pretrained = classmethod(stand_in)
    try:
        yield
    finally:
        for cls_name, original in saved.items():
            cls = getattr(diffusers, cls_name)
            if original is None:
                del cls.from_pretrained
            else:
                cls.from_pretrained = original
