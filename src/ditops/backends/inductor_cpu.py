"""torch.compile's CPU backend (Inductor's C++ code): what compiled FlexAttention needs on CPU.

FlexAttention is fast only compiled, and on CPU Inductor writes C++ and builds it with
the machine's C++ compiler, so the probe asks Inductor which compiler it would call and
whether that compiler is installed. Nothing is compiled by the probe; a compile that
fails later is a path failure (one warning, the call falls back).

``amx_tiles()``: whether this CPU has AMX tiles (Sapphire Rapids and later). Inductor's
FlexAttention template runs its bf16/fp16 tiles on AMX there, and only there does it beat
the gathered-SDPA kernel (``benchmarks/cpu/probes/sparse_kernel_wan.txt``).

:func:`warn_if_known_to_fail`: the README's known issue (NaN from inductor's code around
ditops' kernels, bf16, on a CPU with AMX) warns once when such a graph is traced.
"""

from __future__ import annotations

import logging
import shutil

import torch

from ditops.backends.base import Backend
from ditops.tracing import trace_time_constant

logger = logging.getLogger("ditops")


class InductorCpuBackend(Backend):
    name = "inductor-cpu"
    install_hint = (
        "install a C++ compiler (g++ or clang++) for torch.compile's CPU backend, or set CXX to one"
    )

    def _probe(self) -> list[str]:
        try:
            from torch._inductor import cpp_builder

            compiler = cpp_builder.get_cpp_compiler()
        except Exception as exc:  # noqa: BLE001 - any failure means no compiler to use
            return [
                f"torch.compile's CPU backend found no C++ compiler ({exc}); {self.install_hint}"
            ]
        if shutil.which(compiler) is None:
            return [
                f"the C++ compiler {compiler!r} that torch.compile would call is not "
                f"installed; {self.install_hint}"
            ]
        return []


_amx: list[bool] = []  # the answer, once asked


def amx_tiles() -> bool:
    """True when this CPU has AMX tiles and torch can use them (asked once)."""
    if not _amx:
        probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
        try:
            _amx.append(bool(probe()) if probe is not None else False)
        except Exception:  # noqa: BLE001 - an unknown CPU answers "no"
            _amx.append(False)
    return _amx[0]


# Asked at import, not first under a trace: dynamo refuses to trace torch's probe, so a
# fullgraph compile whose first op call asks (the estimate's path reasons) would break.
amx_tiles()

INDUCTOR_CPU = InductorCpuBackend()


#: The README's known issue "torch.compile with inductor on CPU" (issue 25, item 9).
KNOWN_ISSUE = (
    "ditops: torch.compile with the inductor backend, on a CPU with AMX, in bfloat16: a "
    "compiled patched Wan returned NaN on such a CPU (torch 2.13; README, Known issues, "
    "'torch.compile with inductor on CPU'; ditops issue 25; cause not found: every ditops "
    "op's fake implementation matches its kernel). Compile with backend='aot_eager', or "
    "compile the model unpatched, or set torch._inductor.config.cpp.simdlen = 1 (right "
    "there); check the output for NaN."
)
_warned_known_issue: list[bool] = []


def _compiling_backend() -> str:
    """The name of the backend the current dynamo trace compiles for ("" if unknown).
    Reads dynamo's private translator state (torch 2.13), at trace time only."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        fn = InstructionTranslator.current_tx().output.compiler_fn
    except Exception:  # noqa: BLE001 - a torch that moved it: no answer, no warning
        return ""
    return str(getattr(fn, "compiler_name", None) or getattr(fn, "__name__", ""))


@trace_time_constant
def warn_if_known_to_fail(device_type: str, bf16: bool) -> bool:
    """At trace time, when a ditops kernel is put into a graph: warn once per process
    when that graph is for inductor on a CPU with AMX tiles and the call is bf16 (where
    it failed: :data:`KNOWN_ISSUE`). Returns whether it warned now (a trace-time
    constant)."""
    if _warned_known_issue or device_type != "cpu" or not bf16:
        return False
    if _compiling_backend() != "inductor" or not amx_tiles():
        return False
    _warned_known_issue.append(True)
    logger.warning(KNOWN_ISSUE)
    return True
