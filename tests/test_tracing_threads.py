"""ditops asks "is this frame being traced?", not torch.compiler.is_compiling(): the latter
is one flag for the whole process, true while *any* thread compiles (measured: a thread
polling it saw it true all through another thread's torch.compile). An eager call in
another thread must then still run eagerly: its dispatch, its non-finite check, compiled
FlexAttention (not the eager reference).

The other thread's compile is stood in for by setting that process-wide flag, which is
what torch.compile does (``torch.compiler._compile_session_context``)."""

from __future__ import annotations

import pytest
import torch

import ditops.core.dispatch as dispatch_module
import ditops.kernels.flex_attention as flex_kernel
import ditops.ops.block_sparse_attention as bsa_op
from ditops.ops.block_sparse_attention import CPU_FLEX_MIN_TOKENS, block_sparse_attention
from ditops.ops.layer_norm import fp32_layer_norm
from tests.attention.helpers import random_mask


@pytest.fixture
def another_thread_compiling(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)
    assert torch.compiler.is_compiling()


def test_an_eager_op_call_dispatches_eagerly(
    another_thread_compiling, monkeypatch: pytest.MonkeyPatch
) -> None:
    def traced(*a, **kw):
        raise AssertionError("an eager call took the trace-time dispatch")

    monkeypatch.setattr(dispatch_module, "run_traced", traced)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    w, b = torch.ones(64), torch.zeros(64)
    with torch.no_grad():
        out = fp32_layer_norm(x, (64,), w, b, 1e-6)
    want = torch.nn.functional.layer_norm(x.float(), (64,), w, b, 1e-6).bfloat16()
    assert torch.equal(out, want)


def test_an_eager_sparse_call_keeps_its_non_finite_rule_and_compiled_flex(
    another_thread_compiling, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bsa_op, "amx_tiles", lambda: True)
    seq = CPU_FLEX_MIN_TOKENS + 1
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, seq, 32, generator=gen).bfloat16() for _ in range(3))
    blocks = -(-seq // 128)
    mask, counts = random_mask(1, 2, blocks, blocks, seed=3, density=0.25)
    with torch.no_grad():
        assert block_sparse_attention.op.explain_call(q, k, v, mask, counts).chosen == (
            "forward_cpu_flex"
        )
        block_sparse_attention(q, k, v, mask, counts)  # compiles (holds its own function)
        eager_calls: list[int] = []
        real = flex_kernel.flex_attention

        def eager(*a, **kw):
            eager_calls.append(1)
            return real(*a, **kw)

        monkeypatch.setattr(flex_kernel, "flex_attention", eager)  # what runs uncompiled
        block_sparse_attention(q, k, v, mask, counts)
        assert not eager_calls  # compiled, not the eager reference
        # NaN in v: the meaning spreads it to every row of the head (0 * NaN in its dense
        # P @ V); the fast paths only to the rows keeping its block, so the eager rule
        # (non-finite input on CPU: run the meaning) must hold.
        v = v.clone()
        v[0, 0, 5, 0] = float("nan")
        out = block_sparse_attention(q, k, v, mask, counts)
    want = block_sparse_attention.op.forward_native(q, k, v, mask, counts)
    assert torch.equal(out.isnan(), want.isnan()) and bool(want.isnan().any())


def test_no_module_asks_the_process_wide_flag() -> None:
    """Every "am I traced?" goes through ditops.tracing.traced()."""
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "src" / "ditops"
    offenders = [
        str(p.relative_to(src))
        for p in src.rglob("*.py")
        if p.name != "tracing.py" and "compiler.is_compiling()" in p.read_text()
    ]
    assert not offenders, offenders
