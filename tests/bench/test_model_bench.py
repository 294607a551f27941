"""Each model bench is a declaration on :mod:`ditops.bench.model_bench`'s runner."""

from __future__ import annotations

import importlib
import inspect

import pytest

from ditops.bench.model_bench import MODEL_BENCHES, ModelBench

pytest.importorskip("diffusers", reason="the diffusers extra is part of the test install")


@pytest.mark.parametrize("name", MODEL_BENCHES)
def test_a_model_bench_is_a_short_declaration(name: str) -> None:
    module = importlib.import_module(f"ditops.bench.{name}")
    bench = module.BENCH
    assert isinstance(bench, ModelBench) and bench.name == name
    lines = len(inspect.getsource(module).splitlines())
    assert lines <= 110, f"bench/{name}.py has {lines} lines: move the mechanics to the runner"
    # what it declares is enough to run: every shape keyword has a default in every size
    for size, spec in bench.sizes.items():
        assert {"config", "rounds", *bench.shape} <= set(spec), (name, size)
    import diffusers

    assert isinstance(getattr(diffusers, bench.model), type)


def test_an_unknown_size_is_refused_naming_the_bench() -> None:
    from ditops.bench import ltx_video

    with pytest.raises(ValueError, match="ltx_video bench: size must be one of"):
        ltx_video.run(__import__("torch").device("cpu"), "huge")
