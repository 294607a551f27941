"""What every patched model of a declared family must survive, written once: deep copies,
pickling, patching again, torch.compile before any eager call, the Triton paths, offload
hooks, and refusals that change nothing. A family's test module describes its tiny model
as a :class:`Life` and subclasses :class:`FamilyContract` with it (``class
TestContract(FamilyContract)``; :class:`OffloadContract` adds the offload modes), and
keeps only its own tests: its tiny model, inputs and what no other family has."""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

import ditops
from ditops import config
from ditops.attention.schedule import BlockSparseConfig
from ditops.custom_op import reset_state
from ditops.integrations import PatchError
from tests.integrations.spies import install_spies
from tests.precision import max_rel_err


def first_output(model: nn.Module, **inputs: Any) -> Any:
    """The model's first output under inference mode (most families' ``run``)."""
    with torch.inference_mode():
        return model(**inputs, return_dict=False)[0]


@dataclass
class Life:
    """A family's tiny model, as the checks below use it."""

    #: ``make(dtype=bf16, **config_overrides)``: the tiny model, seeded.
    make: Callable[..., nn.Module]
    #: ``inputs()``: keyword arguments of one forward.
    inputs: Callable[[], dict]
    #: diffusers' processor class the attention of :meth:`block` has unpatched.
    processor: type
    #: ``cases(dtype, **case)``: the inputs of one case of the parity tests.
    cases: Callable[..., dict] | None = None
    #: ``run(model, **inputs)``: the output, under inference mode.
    run: Callable[..., Any] = first_output
    #: Whether two outputs are bitwise equal.
    same: Callable[[Any, Any], bool] = torch.equal
    #: The model's list of fused blocks and a block's attention module, by name.
    blocks: str = "transformer_blocks"
    attn: str = "attn"

    def block(self, model: nn.Module) -> nn.Module:
        """A fused block of a model (where ``forward`` is patched on the instance)."""
        return getattr(model, self.blocks)[0]

    def attention(self, model: nn.Module) -> nn.Module:
        """Its attention module (where the processor is swapped)."""
        return getattr(self.block(model), self.attn)


def changed(owner: object, name: str) -> Callable[[pytest.MonkeyPatch, nn.Module], None]:
    """A change for :func:`refused_whole`: ``owner.<name>`` replaced by a wrapper calling
    it: the same arithmetic, another source, so another fingerprint (a diffusers version
    ditops does not know)."""

    def change(monkeypatch: pytest.MonkeyPatch, model: nn.Module) -> None:
        change_source(monkeypatch, owner, name)

    return change


def setting(path: str, name: str, value: Any) -> Callable[[pytest.MonkeyPatch, nn.Module], None]:
    """A change for :func:`refused_whole`: ``model.get_submodule(path).<name> = value``
    (a q/k norm's eps that differs from its pair's, say)."""

    def change(monkeypatch: pytest.MonkeyPatch, model: nn.Module) -> None:
        monkeypatch.setattr(model.get_submodule(path), name, value)

    return change


def change_source(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> None:
    """Replace ``owner.<name>`` by a wrapper calling it (see :func:`changed`)."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)


def cached_steps(model: nn.Module, x: dict, timesteps: list[torch.Tensor]) -> list[torch.Tensor]:
    """One output per timestep, each call in ``cache_context("cond", step_index=i)``."""
    outs = []
    with torch.inference_mode():
        for i, t in enumerate(timesteps):
            with model.cache_context("cond", step_index=i):
                outs.append(model(**{**x, "timestep": t}, return_dict=False)[0])
    return outs


def unpatched(life: Life, model: nn.Module) -> bool:
    """Whether ``model`` shows no trace of a patch."""
    processors = [getattr(m, "processor", None) for m in model.modules()]
    return (
        not hasattr(model, "_ditops_patch")
        and "forward" not in vars(life.block(model))
        and type(life.attention(model).processor) is life.processor
        and not any(type(p).__module__.startswith("ditops") for p in processors if p)
    )


def refused_whole(
    life: Life, change: Callable, fragment: str, mp: pytest.MonkeyPatch, **options: Any
) -> None:
    """``change(monkeypatch, model)`` makes the model one ``patch(model, **options)`` must
    refuse, naming ``fragment``; nothing changes, and once the change is undone the model
    is itself."""
    model = life.make()
    x = life.inputs()
    ref = life.run(model, **x)
    change(mp, model)
    processor = type(life.attention(model).processor)  # the change's own, if it set one
    with pytest.raises(PatchError, match=fragment):
        ditops.patch(model, **options)
    assert unpatched(replace(life, processor=processor), model)
    mp.undo()
    assert life.same(life.run(model, **x), ref)


def sparse_refused(life: Life) -> None:
    """The error names the families that serve sparse attention and the model's class."""
    model = life.make()
    name = type(model).__name__
    pattern = r"sparse attention is supported for .*WanTransformer3DModel.*not for " + name
    with pytest.raises(PatchError, match=pattern):
        ditops.patch(model, attention=BlockSparseConfig(sparsity=0.5))
    assert unpatched(life, model)


def deep_copy_is_independent(life: Life, weights: Callable[[nn.Module], list]) -> None:
    """A deep copy of a patched model runs its own ``weights(model)`` (halved in the copy),
    leaves the original alone, and unpatches on its own."""
    model = life.make()
    x = life.inputs()
    ditops.patch(model, precision="exact")
    before = life.run(model, **x)
    twin = copy.deepcopy(model)
    assert life.same(life.run(twin, **x), before)
    with torch.no_grad():
        for w in weights(twin):
            w.mul_(0.5)
    changed = life.run(twin, **x)
    assert not life.same(changed, before)  # the copy runs its own weights
    assert life.same(life.run(model, **x), before)
    ditops.unpatch(twin)
    assert life.same(life.run(twin, **x), changed)  # exact: unpatched, the same bits
    assert hasattr(model, "_ditops_patch")


def patched_model_pickles(life: Life) -> None:
    model = life.make()
    x = life.inputs()
    ditops.patch(model, precision="fast")
    before = life.run(model, **x)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert life.same(life.run(loaded, **x), before)
    assert pickle.loads(pickle.dumps(model))._ditops_patch.options == model._ditops_patch.options
    ditops.unpatch(loaded)
    assert unpatched(life, loaded)
    assert life.same(life.run(loaded, **x), life.run(life.make(), **x))


def patching_again_switches_precision(life: Life) -> None:
    model = life.make()
    x = life.inputs()
    ref = life.run(model, **x)
    ditops.patch(model, precision="fast")
    fast = life.run(model, **x)
    assert not life.same(fast, ref)  # fast rounds once: some bits differ
    ditops.patch(model, norms=True)  # precision kept
    assert model._ditops_patch.options.precision == "fast"
    assert life.same(life.run(model, **x), fast)
    ditops.patch(model, precision="exact")
    assert life.same(life.run(model, **x), ref)


def compile_first_fullgraph(
    life: Life, prepare: Callable[[nn.Module], None] | None = None, fullgraph: bool = True
) -> None:
    """The whole patched model (one block of each kind: ``make`` is given the overrides)
    compiled before any eager call of an op, fullgraph, aot_eager (dynamo and AOT tracing
    through the kernels' fake implementations), no recompile on the second call, bitwise
    the unpatched model. ``prepare(model)``: what must run eagerly first (not ditops');
    ``fullgraph=False`` where diffusers' forward breaks the graph (then recompiles are
    allowed)."""
    x = life.inputs()
    model = life.make()
    if prepare is not None:
        prepare(model)
    ditops.patch(model, precision="exact")
    compiled = torch.compile(model, fullgraph=fullgraph, backend="aot_eager")
    # not fullgraph: dynamo resumes after each break, which may recompile there
    with torch._dynamo.config.patch(error_on_recompile=fullgraph):
        first = life.run(compiled, **x)
        again = life.run(compiled, **x)
    assert life.same(first, again)
    assert life.same(first, life.run(life.make(), **x))


def on_the_triton_paths(
    life: Life, mp: pytest.MonkeyPatch, op_names: tuple[str, ...], tolerance: float
) -> dict[str, int]:
    """The patched model, fast precision, with every fused op on its Triton path (CPU
    tensors through Triton's interpreter, dispatched as CUDA; strict: a fall back would
    raise), within ``tolerance`` of the unpatched model; returns the calls of each op."""
    model = life.make()
    x = life.inputs()
    ref = life.run(model, **x)
    ditops.patch(model, precision="fast")
    reset_state()
    try:
        with ditops.force_device_kind({"cpu": "cuda"}), config.override(strict=True):
            ops = [ditops.registered_ops()[name] for name in op_names]
            used = install_spies(mp, ops, "forward_cuda")
            out = life.run(model, **x)
    finally:
        reset_state()
    outs, refs = (o if isinstance(o, list) else [o] for o in (out, ref))
    assert all(max_rel_err(o, r) <= tolerance for o, r in zip(outs, refs))
    return used


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def batches(*cases: tuple[str, int]) -> list[tuple[str, dict]]:
    """:attr:`FamilyContract.exact_cases` of ``(dtype, batch)`` pairs."""
    return [(dtype, {"batch": batch}) for dtype, batch in cases]


def case_id(case: tuple[str, dict]) -> str:
    dtype, kw = case
    return "-".join([dtype, *(f"{k}={v}" for k, v in kw.items())])


def generate_cases(metafunc: pytest.Metafunc) -> None:
    """``pytest_generate_tests`` of the integration tests: a contract's ``exact_case``
    from its class's :attr:`FamilyContract.exact_cases`, ``fast_dtype`` every dtype."""
    cls = metafunc.cls
    if cls is None or not issubclass(cls, FamilyContract):
        return
    if "exact_case" in metafunc.fixturenames:
        cases = cls.exact_cases
        metafunc.parametrize("exact_case", cases, ids=[case_id(c) for c in cases])
    if "fast_dtype" in metafunc.fixturenames:
        metafunc.parametrize("fast_dtype", list(DTYPES))


class FamilyContract:
    """The checks above as tests: a family's test module subclasses this with its tiny
    model (:attr:`life`), its inputs of one case in a dtype (:meth:`case_inputs`), the
    weights a deep copy halves (:meth:`weights`), the model of one block of each kind that
    compile and the Triton paths run (:meth:`small`) and what each op is called there
    (:attr:`triton_calls`). The exact test spies with the module's ``cpu_paths`` fixture
    (``spies.cpu_paths_of``). A family that serves sparse attention sets
    ``test_sparse_attention_is_refused_naming_the_families_that_serve_it = None`` and tests
    its density itself; likewise a family whose parity tests are its own."""

    life: ClassVar[Life]
    #: The ops on the Triton paths, the relative tolerance, and each op's calls there.
    triton_ops: ClassVar[tuple[str, ...]]
    triton_tolerance: ClassVar[float]
    triton_calls: ClassVar[dict[str, int]]
    #: The exact test's cases: a dtype name and :meth:`case_inputs`' keyword arguments.
    exact_cases: ClassVar[list[tuple[str, dict]]] = []
    #: What the exact patch reports for ``life.make``'s model.
    fused: ClassVar[dict[str, int]]
    #: The calls of each spied op's CPU path per forward in the exact test.
    cpu_calls: ClassVar[dict[str, int]]
    #: The fast test's :meth:`case_inputs` keyword arguments; whether fp32 is bitwise.
    fast_case: ClassVar[dict] = {}
    fast_fp32_is_exact: ClassVar[bool] = False
    #: Whether the patched model compiles as one graph (not where diffusers' forward
    #: breaks it, unpatched too).
    fullgraph: ClassVar[bool] = True

    def weights(self, model: nn.Module) -> list[torch.Tensor]:
        """The weights a deep copy halves (its own, not the original's)."""
        raise NotImplementedError

    def small(self) -> Life:
        """The model with one block of each kind."""
        raise NotImplementedError

    def case_inputs(self, dtype: torch.dtype, **case: Any) -> dict:
        """The inputs of one case of the parity tests (by default ``life.cases``)."""
        assert self.life.cases is not None, "Life(cases=...) or a case_inputs method"
        return self.life.cases(dtype, **case)

    def test_exact_patch_is_bitwise_equal_and_unpatch_restores(
        self, exact_case: tuple[str, dict], cpu_paths: dict[str, int]
    ) -> None:
        """Bitwise the unpatched model, the fused CPU paths counted (a silent fall back to
        the eager expressions would be trivially equal); unpatched, itself again."""
        life, (dtype, case) = self.life, exact_case
        model = life.make(DTYPES[dtype])
        x = self.case_inputs(DTYPES[dtype], **case)
        ref = life.run(model, **x)
        assert ditops.patch(model, precision="exact").models[type(model).__name__] == self.fused
        assert life.same(life.run(model, **x), ref)
        assert cpu_paths == self.cpu_calls
        assert life.same(life.run(model, **x), ref)
        assert cpu_paths == {op: 2 * n for op, n in self.cpu_calls.items()}  # per forward
        ditops.unpatch(model)
        assert unpatched(life, model)
        assert life.same(life.run(model, **x), ref)

    def test_fast_patch_within_tolerance(self, fast_dtype: str) -> None:
        life, dtype = self.life, DTYPES[fast_dtype]
        model = life.make(dtype)
        x = self.case_inputs(dtype, **self.fast_case)
        ref = life.run(model, **x)
        ditops.patch(model, precision="fast")
        out = life.run(model, **x)
        outs, refs = (o if isinstance(o, list) else [o] for o in (out, ref))
        for o, r in zip(outs, refs):
            assert o.dtype == r.dtype
            assert max_rel_err(o, r) <= self.triton_tolerance
        if self.fast_fp32_is_exact and dtype == torch.float32:  # fp32 takes the exact paths
            assert life.same(out, ref)

    def compiled(self) -> Life:
        """The model compile runs (by default :meth:`small`'s)."""
        return self.small()

    def prepare_compile(self, model: nn.Module) -> None:
        """What must run eagerly before compiling (not ditops')."""

    def test_sparse_attention_is_refused_naming_the_families_that_serve_it(self) -> None:
        sparse_refused(self.life)

    def test_deep_copy_is_an_independent_patched_model(self) -> None:
        deep_copy_is_independent(self.life, self.weights)

    def test_patched_model_pickles(self) -> None:
        patched_model_pickles(self.life)

    def test_patching_again_switches_precision(self) -> None:
        patching_again_switches_precision(self.life)

    @pytest.mark.slow
    @pytest.mark.usefixtures("fresh_process")
    def test_compile_first_fullgraph_without_recompiles(self) -> None:
        compile_first_fullgraph(self.compiled(), self.prepare_compile, self.fullgraph)

    def test_patched_model_on_the_triton_paths(self, monkeypatch: pytest.MonkeyPatch) -> None:
        used = on_the_triton_paths(
            self.small(), monkeypatch, self.triton_ops, self.triton_tolerance
        )
        assert used == self.triton_calls


def offload_matches(life: Life, mode: str, order: str, tmp: Any) -> dict[str, str]:
    """The exact-patched model under an offload mode of tests/integrations/test_offload.py
    (applied before or after the patch: ``order``) is bitwise the unpatched model under
    the same offload; returns ``explain_patch``'s places for the caller to check."""
    from tests.integrations.test_offload import MODES

    apply = MODES[mode][0]
    x = life.inputs()
    plain = life.make()
    apply(plain, tmp / "a")
    want = life.run(plain, **x)
    model = life.make()
    if order == "offload-first":
        apply(model, tmp / "b")
    ditops.patch(model, precision="exact")
    if order == "patch-first":
        apply(model, tmp / "b")
    assert life.same(life.run(model, **x), want)
    return ditops.explain_patch(model)[type(model).__name__]


class OffloadContract:
    """diffusers' and accelerate's offload modes in both orders (tests/integrations/
    test_offload.py): bitwise the unpatched model under the same offload; ``offloaded``
    checks what stayed fused (``explain_patch``'s places), given the fixtures named in
    :attr:`offload_fixtures` (set up before the model runs: a ``cpu_paths`` spy)."""

    life: ClassVar[Life]
    offload_fixtures: ClassVar[tuple[str, ...]] = ()

    def offloaded(self, places: dict[str, str], mode: str, **fixtures: Any) -> None:
        raise NotImplementedError

    @pytest.mark.parametrize("mode", ["model", "sequential", "group-block", "group-leaf"])
    @pytest.mark.parametrize("order", ["offload-first", "patch-first"])
    def test_offload_gives_the_unpatched_model_under_the_same_offload(
        self, mode: str, order: str, tmp_path: Any, request: pytest.FixtureRequest
    ) -> None:
        fixtures = {name: request.getfixturevalue(name) for name in self.offload_fixtures}
        self.offloaded(offload_matches(self.life, mode, order, tmp_path), mode, **fixtures)


class HookContract:
    """A torch hook on a norm a fused block bypasses: that block runs diffusers' forward
    (the report says why), the hook sees its call, the output is bitwise."""

    life: ClassVar[Life]
    #: The hooked norm's path, and the fused blocks left.
    hooked: ClassVar[tuple[str, int]]

    def test_a_hook_on_a_bypassed_norm_runs_that_block_unfused(self) -> None:
        life, (path, fused) = self.life, self.hooked
        model, x = life.make(), life.inputs()
        seen: list[int] = []
        model.get_submodule(path).register_forward_hook(lambda *_: seen.append(1))
        ref = life.run(model, **x)
        report = ditops.patch(model, precision="exact")
        name, (block, _, norm) = type(model).__name__, path.rpartition(".")
        assert report.models[name]["fused blocks"] == fused
        assert report.models[name]["unfused blocks"] == 1
        assert report.unfused[name][block] == f"{norm} has a torch forward hook"
        seen.clear()
        assert life.same(life.run(model, **x), ref)
        assert seen == [1]  # the hook still runs
