"""Every ditops custom op's fake implementation agrees with its real kernel (issue 25, item 9).

Under torch.compile a graph calls ditops' kernels as custom ops (``kernels/opaque.py``);
AOT tracing and inductor plan the graph from their *fake* implementations alone. A fake
whose output strides, dtype or shape differ from the real kernel's, or a kernel that
returns a view of an input or writes into one (none are declared), lets inductor read or
reuse memory wrongly: the usual cause of wrong values or NaN that only compiled graphs
show (the README's known issue with inductor on CPU).

The calls checked are the ones real models make: tiny Wan (bf16 with fp32 norms, fast and
exact, sparse attention) and HunyuanVideo forwards are run with the opaque ops forced (as
when traced) under a dispatch mode that records each ``ditops::`` call with its
arguments; the Triton ops the same way with the tensors dispatched as CUDA (Triton's
interpreter runs them on CPU). Each call then runs again as recorded and with its tensors
made non-contiguous (same values, transposed strides), real and under a FakeTensorMode.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

import ditops
import ditops.kernels.opaque as opaque_mod
from ditops.attention.schedule import BlockSparseConfig
from ditops.custom_op import reset_state

Call = tuple[Any, tuple[Any, ...], dict[str, Any]]
pytestmark = pytest.mark.slow  # four model forwards, Triton's interpreter for two


class _Recorder(TorchDispatchMode):
    """Records every ``ditops::`` op call (the op overload, its args and kwargs)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Call] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "ditops":
            self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)


def _forwards() -> Iterator[Callable[[], None]]:
    from tests.integrations import test_diffusers_hunyuan_video as hy
    from tests.integrations import test_diffusers_ltx_video as ltx
    from tests.integrations import test_diffusers_mochi as mochi
    from tests.integrations import test_diffusers_wan as wan

    sparse = BlockSparseConfig(sparsity=0.5, skip_first_steps=0, block_size=32, stride=4)
    for precision in ("fast", "exact"):

        def wan_forward(precision: str = precision) -> None:
            model = wan.tiny_wan(keep_fp32=True)
            ditops.patch(model, precision=precision, attention=sparse)
            wan.run(model, step=1, **wan.inputs(frames=8, hw=16))

        def hunyuan_forward(precision: str = precision) -> None:
            model = hy.tiny_hunyuan(num_layers=1, num_single_layers=1)
            ditops.patch(model, precision=precision)
            hy.run(model, **hy.inputs(batch=2))

        def modulated_rms_forwards(precision: str = precision) -> None:
            # rms_norm_scale: Mochi's fp32 upcast, LTX-Video's weighted norm with a shift
            model = mochi.tiny_mochi(torch.bfloat16)
            ditops.patch(model, precision=precision)
            mochi.run(model, **mochi.inputs(torch.bfloat16))
            model = ltx.tiny_ltx(torch.bfloat16, norm_elementwise_affine=True)
            ditops.patch(model, precision=precision)
            ltx.run(model, **ltx.inputs(torch.bfloat16))

        yield wan_forward
        yield hunyuan_forward
        yield modulated_rms_forwards


@pytest.fixture(scope="module")
def calls() -> list[Call]:
    """The ``ditops::`` calls of real forwards, on the CPU kernels and the Triton ones."""
    mp = pytest.MonkeyPatch()
    mp.setattr(opaque_mod, "traced", lambda: True)  # the custom op, as in a graph
    recorder = _Recorder()
    torch._dynamo.reset()  # nothing compiled by earlier tests serves these forwards
    try:
        for device_kind in (None, "cuda"):
            reset_state()
            for forward in _forwards():
                if device_kind is None:
                    with recorder:
                        forward()
                else:
                    with ditops.force_device_kind({"cpu": device_kind}), recorder:
                        forward()
    finally:
        reset_state()
        mp.undo()
        # The forwards above ran with ditops' traced() forced true: what dynamo compiled
        # then (FlexAttention for these shapes) must not serve the tests that follow.
        torch._dynamo.reset()
    return recorder.calls


def _non_contiguous(x: Any) -> Any:
    """The same values with transposed strides (a tensor of dim >= 2 and more than one
    element per last two dims); anything else as it is."""
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or min(x.shape[-2:]) < 2:
        return x
    return x.transpose(-1, -2).contiguous().transpose(-1, -2)


def _storages(ts: list[Any]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in ts if isinstance(t, torch.Tensor)}


def _problems(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
    """What differs between the real call and its fake; what the real one aliases or
    mutates."""
    before = [x.clone() if isinstance(x, torch.Tensor) else x for x in args]
    real = func(*args, **kwargs)
    mode = FakeTensorMode()
    to_fake = lambda x: mode.from_tensor(x) if isinstance(x, torch.Tensor) else x  # noqa: E731
    with mode:
        fake = func(*tree_map(to_fake, args), **tree_map(to_fake, kwargs))
    found = []
    reals, fakes = tree_leaves(real), tree_leaves(fake)
    if len(reals) != len(fakes):
        found.append(f"{len(reals)} real outputs, {len(fakes)} fake")
    for i, (r, f) in enumerate(zip(reals, fakes)):
        got = (tuple(r.shape), r.dtype, r.stride(), r.storage_offset())
        want = (tuple(f.shape), f.dtype, f.stride(), f.storage_offset())
        if got != want:
            found.append(f"output {i}: real (shape, dtype, strides, offset) {got}, fake {want}")
    if _storages(reals) & _storages(list(args) + tree_leaves(kwargs)):
        found.append("an output shares memory with an input (no alias is declared)")
    if len(_storages(reals)) != len(reals):
        found.append("two outputs share memory")
    for i, (b, x) in enumerate(zip(before, args)):
        if isinstance(x, torch.Tensor) and not torch.equal(b.nan_to_num(), x.nan_to_num()):
            found.append(f"argument {i} was written to (no mutation is declared)")
    return found


def test_fake_outputs_match_the_real_kernels(calls: list[Call]) -> None:
    problems = []
    for func, args, kwargs in calls:
        for variant, a in (
            ("as called", args),
            ("non-contiguous", tree_map(_non_contiguous, args)),
        ):
            problems += [f"{func} ({variant}): {p}" for p in _problems(func, a, kwargs)]
    assert problems == [], "\n".join(problems)


def test_the_non_contiguous_variant_changes_strides(calls: list[Call]) -> None:
    # Else the second variant would check nothing new.
    changed = sum(
        any(isinstance(x, torch.Tensor) and _non_contiguous(x).stride() != x.stride() for x in args)
        for _, args, _ in calls
    )
    assert changed >= len(calls) // 2, (changed, len(calls))


#: ditops ops no forward above reaches, each checked on its own below: the Triton GELU
#: (FLUX's feed-forward), the rotations alone (a prologue with its norms fuses them), the
#: Triton antidiagonal block scores (the forwards' sparse attention samples rows instead).
NOT_IN_THE_FORWARDS = {
    "triton_gelu_tanh_bias",
    "cpu_rotary_embedding",
    "triton_rotary_embedding",
    "triton_estimate_block_scores",
}


def test_every_ditops_op_is_checked(calls: list[Call]) -> None:
    # Both register their ops on import: the set below is then the same in any test order.
    import ditops.kernels.triton.estimate
    import ditops.kernels.triton.gelu  # noqa: F401

    registered = {
        name
        for name in dir(torch.ops.ditops)
        if hasattr(getattr(torch.ops.ditops, name, None), "default")
    }
    seen = {func.overloadpacket.__name__ for func, _, _ in calls}
    assert registered - seen == NOT_IN_THE_FORWARDS, registered - seen


def test_triton_gelu_fake_matches() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, 32, generator=g).bfloat16()
    bias = torch.randn(32, generator=g).bfloat16()
    op = torch.ops.ditops.triton_gelu_tanh_bias.default
    for a in ((x, bias), (_non_contiguous(x), bias), (x, None)):
        assert _problems(op, a, {}) == []


def test_triton_block_scores_fake_matches() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 256, 32, generator=g).bfloat16()
    k = torch.randn(1, 2, 384, 32, generator=g).bfloat16()
    op = torch.ops.ditops.triton_estimate_block_scores.default
    for causal in (False, True):
        for a in ((q, k), (_non_contiguous(q), k)):
            assert _problems(op, (*a, 128, 8, 0.125, causal, 1), {}) == []


def test_rotary_embedding_fakes_match(calls: list[Call]) -> None:
    """On the q and the cos/sin tables of the recorded prologue calls (Wan's strided
    interleaved tables, HunyuanVideo's), on both the CPU and the Triton op."""
    problems = []
    for func, args, _ in calls:
        name = func.overloadpacket.__name__
        if not name.endswith("qk_norm_rope"):
            continue
        q, cos, sin, layout = args[0], args[4], args[5], args[8]
        rotary = getattr(torch.ops.ditops, name.replace("qk_norm_rope", "rotary_embedding"))
        for a in ((q, cos, sin, layout), (_non_contiguous(q), cos, sin, layout)):
            problems += [f"{rotary} {p}" for p in _problems(rotary.default, a, {})]
    assert problems == [], "\n".join(problems)


def test_the_check_sees_a_fake_with_other_strides() -> None:
    """The comparison can fail: an op whose kernel returns transposed strides while its
    fake says contiguous."""

    @torch.library.custom_op("ditops_test::transposed_copy", mutates_args=())
    def transposed_copy(x: torch.Tensor) -> torch.Tensor:
        return x.t().contiguous().t()

    transposed_copy.register_fake(lambda x: torch.empty(x.shape, dtype=x.dtype))
    found = _problems(torch.ops.ditops_test.transposed_copy.default, (torch.randn(3, 4),), {})
    assert len(found) == 1 and "strides" in found[0], found
