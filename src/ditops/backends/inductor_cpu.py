"""torch.compile's CPU backend (Inductor's C++ code): what compiled FlexAttention needs on CPU.

FlexAttention is fast only compiled, and on CPU Inductor writes C++ and builds it with
the machine's C++ compiler, so the probe asks Inductor which compiler it would call and
whether that compiler is installed. Nothing is compiled by the probe; a compile that
fails later is a path failure (one warning, the call falls back).

``amx_tiles()``: whether this CPU has AMX tiles (Sapphire Rapids and later). Inductor's
FlexAttention template runs its bf16/fp16 tiles on AMX there, and only there does it beat
the gathered-SDPA kernel (``benchmarks/cpu/probes/sparse_kernel_wan.txt``).
"""

from __future__ import annotations

import shutil

import torch

from ditops.backends.base import Backend


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
            return [f"torch.compile's CPU backend found no C++ compiler ({exc}); "
                    f"{self.install_hint}"]  # fmt: skip
        if shutil.which(compiler) is None:
            return [f"the C++ compiler {compiler!r} that torch.compile would call is not "
                    f"installed; {self.install_hint}"]  # fmt: skip
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


INDUCTOR_CPU = InductorCpuBackend()
