"""block_sparse_attention on CPU: when compiled FlexAttention serves a call, when the
gathered-SDPA path does, and what happens when FlexAttention cannot run.

Whether this machine has AMX is replaced by a stand-in either way (``amx_tiles``), so the
choice is tested the same on any CPU; the FlexAttention code itself runs (compiled) on
every CPU, AMX or not. The numerics of the path are tested in
``tests/layers/test_attention.py::test_causal_bf16_odd_length[cpu_flex]``.
"""

from __future__ import annotations

import logging

import pytest
import torch

import ditops.kernels.flex_attention as flex_kernel
import ditops.ops.block_sparse_attention as bsa_op
from ditops import config
from ditops.backends.inductor_cpu import INDUCTOR_CPU
from ditops.core import tune
from ditops.core.registry import reset_state
from ditops.custom_op import BackendUnavailableError
from ditops.ops.block_sparse_attention import CPU_FLEX_MIN_TOKENS, block_sparse_attention
from tests.attention.helpers import random_mask

LONG = CPU_FLEX_MIN_TOKENS + 1  # one partial block more than the threshold


def inputs(seq: int, dtype: torch.dtype = torch.bfloat16):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, seq, 32, generator=gen).to(dtype) for _ in range(3))
    blocks = -(-seq // 128)
    mask, counts = random_mask(1, 2, blocks, blocks, seed=3, density=0.25)
    return q, k, v, mask, counts


@pytest.fixture
def amx(monkeypatch: pytest.MonkeyPatch):
    """Set whether 'this CPU' has AMX tiles: ``amx(True)``; ``amx(False)`` also takes
    AVX-512-BF16 away (the static rule's other CPU kind), ``amx(False, bf16=True)`` not."""

    def set_amx(value: bool, bf16: bool = False) -> None:
        monkeypatch.setattr(bsa_op, "amx_tiles", lambda: value)
        flags = frozenset({"avx512f", "avx512_bf16"} if bf16 else {"avx2"})
        monkeypatch.setattr(tune, "cpu_flags", lambda: flags)

    return set_amx


def chosen(*args) -> str:
    with torch.no_grad():
        return block_sparse_attention.op.explain_call(*args).chosen


def reasons_of(decision, name: str) -> list[str]:
    return next(c for c in decision.candidates if c.path == name).reasons


def test_bf16_long_sequence_with_amx_takes_flex(amx) -> None:
    amx(True)
    assert chosen(*inputs(LONG)) == "forward_cpu_flex"


def test_avx512_bf16_without_amx_takes_flex_too(amx) -> None:
    amx(False, bf16=True)  # measured there: flex 2.46x dense, gathered 1.47x
    assert chosen(*inputs(LONG)) == "forward_cpu_flex"


@pytest.mark.parametrize("flex_wins", [True, False])
def test_tuning_keeps_the_static_rule_the_two_kernels_give_other_bits(
    amx, monkeypatch: pytest.MonkeyPatch, tmp_path, flex_wins: bool
) -> None:
    """Compiled FlexAttention and the gathered kernel round differently, so they never
    compete (timing never changes a result, ditops.core.same_bits): with DITOPS_TUNE=on
    the static rule's path runs on every call, whichever would be faster."""
    import time

    import ditops.kernels.cpu.block_sparse_attention as gathered_kernel

    amx(False)  # the static rule says gathered
    real = gathered_kernel.gathered_block_sparse_attention
    ran: list[str] = []

    def slow_if(name: str, slow: bool):
        def kernel(*a, **kw):
            ran.append(name)
            time.sleep(0.05 if slow else 0.0)
            return real(*a, **kw) if name == "gathered" else None

        return kernel

    gathered = slow_if("gathered", flex_wins)
    flex = slow_if("flex", not flex_wins)

    def flex_double(qb, kb, vb, block_mask, scale, needs_mask_mod):
        flex()
        return real(qb, kb, vb, args[3], scale, False, 128, False)

    monkeypatch.setattr(gathered_kernel, "gathered_block_sparse_attention", gathered)
    monkeypatch.setattr(flex_kernel, "flex_block_sparse_attention", flex_double)
    args = inputs(LONG)
    reset_state()
    try:
        with config.override(tune="on"), torch.no_grad():
            cfg = config.get()
            config._local.override = config.replace(cfg, cache_dir=str(tmp_path))
            for _ in range(3):
                block_sparse_attention(*args)
            assert ran == ["gathered"] * 3
            assert tune.choices(config.replace(cfg, cache_dir=str(tmp_path))) == {}
    finally:
        reset_state()


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("no_amx", "no AMX or AVX-512-BF16 on this CPU"),
        ("fp32", "dtype float32 not supported"),
        ("fp16", "dtype float16 not supported"),  # not measured: AMX-FP16 is newer
        ("short", f"query tokens < CPU_FLEX_MIN_TOKENS={CPU_FLEX_MIN_TOKENS}"),
    ],
)
def test_otherwise_the_gathered_path_with_the_reason(amx, case: str, reason: str) -> None:
    amx(case != "no_amx")
    seq = CPU_FLEX_MIN_TOKENS - 1 if case == "short" else LONG
    dtype = {"fp32": torch.float32, "fp16": torch.float16}.get(case, torch.bfloat16)
    args = inputs(seq, dtype)
    with torch.no_grad():
        decision = block_sparse_attention.op.explain_call(*args)
    assert decision.chosen == "forward_cpu"
    assert any(reason in r for r in reasons_of(decision, "forward_cpu_flex")), decision


def test_no_cpp_compiler_refuses_flex_with_the_install_hint(
    amx, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch._inductor import cpp_builder

    amx(True)
    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", lambda: "no-such-cxx-ditops")
    INDUCTOR_CPU.reset()
    reset_state()
    try:
        with torch.no_grad():
            decision = block_sparse_attention.op.explain_call(*inputs(LONG))
        assert decision.chosen == "forward_cpu"
        why = " ".join(reasons_of(decision, "forward_cpu_flex"))
        assert "'no-such-cxx-ditops'" in why and "install a C++ compiler" in why
    finally:
        INDUCTOR_CPU.reset()
        reset_state()


def test_flex_failing_at_run_time_falls_back_then_uses_the_gathered_path(
    amx, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    amx(True)
    q, k, v, mask, counts = inputs(LONG)
    calls: list[str] = []

    def broken(*a, **kw):
        calls.append("flex")
        raise RuntimeError("C++ compile error (test double)")

    monkeypatch.setattr(flex_kernel, "flex_block_sparse_attention", broken)
    want = block_sparse_attention.op.forward_native(q, k, v, mask, counts)
    reset_state()
    try:
        with torch.no_grad(), caplog.at_level(logging.WARNING, logger="ditops"):
            first = block_sparse_attention(q, k, v, mask, counts)
            second = block_sparse_attention(q, k, v, mask, counts)
            after = block_sparse_attention.op.explain_call(q, k, v, mask, counts)
        assert calls == ["flex"]  # tried once, then given up
        assert torch.equal(first, want)  # the failed call ran the meaning
        tol = bsa_op.ATTENTION_TOLERANCE[torch.bfloat16][0] * float(v.abs().max())
        assert float((second.float() - want.float()).abs().max()) <= 2 * tol
        assert after.chosen == "forward_cpu"
        warned = [r.getMessage() for r in caplog.records if "falls back" in r.getMessage()]
        assert len(warned) == 1 and "C++ compile error" in warned[0]
        assert "later cpu calls run the next usable of forward_cpu" in warned[0]
        with config.override(strict=True), pytest.raises(BackendUnavailableError):
            reset_state()
            block_sparse_attention(q, k, v, mask, counts)
    finally:
        reset_state()


def test_two_threads_at_once_on_a_new_shape_get_the_same_outputs(amx) -> None:
    """Two threads reach the first (compiling) call of one shape together: each gets the
    output one thread alone gets (Dynamo compiles under its own global lock)."""
    import threading

    amx(True)
    q, k, v, mask, counts = inputs(LONG + 127)  # a shape no other test compiles
    barrier = threading.Barrier(2)
    outs: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            with torch.no_grad():
                barrier.wait(timeout=60)
                outs[i] = block_sparse_attention(q, k, v, mask, counts)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    with torch.no_grad():
        alone = block_sparse_attention(q, k, v, mask, counts)
        assert block_sparse_attention.op.explain_call(q, k, v, mask, counts).chosen == (
            "forward_cpu_flex"
        )
    assert torch.equal(outs[0], alone) and torch.equal(outs[1], alone)


@pytest.mark.parametrize("causal", [False, True])
def test_flex_run_eagerly_still_computes_the_selected_blocks(amx, causal: bool) -> None:
    """FlexAttention that torch.compile does not compile (TORCHDYNAMO_DISABLE=1,
    ``set_stance("force_eager")``, a recompile limit reached) runs its eager reference,
    which reads the block mask's ``mask_mod`` only: that must say which blocks are kept,
    or a row keeping nothing would attend to everything."""
    amx(True)
    q, k, v, mask, counts = inputs(LONG)
    assert int((counts == 0).sum()) > 0  # rows that keep nothing: zeros in the meaning
    want = block_sparse_attention.op.forward_native(q, k, v, mask, counts, causal=causal)
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        got = block_sparse_attention(q, k, v, mask, counts, causal=causal)
    tol = bsa_op.ATTENTION_TOLERANCE[torch.bfloat16]
    bound = tol[0] * float(v.abs().max()) + tol[1] * want.float().abs()
    assert bool(((got.float() - want.float()).abs() <= bound).all())
