"""A test double of the current sgl-kernel-npu wheel, sgl_kernel_npu, for machines without an NPU.

Written from the "API drift" section of ``shared/docs/npu-attentions-ops.md``:

* ``import sgl_kernel_npu`` registers ``torch.ops.npu.{ada_block_sparse_attention,
  sparse_block_estimate}`` (here: a ``torch.library`` fragment of the ``npu`` namespace
  with the CPU kernels of :mod:`tests.doubles.npu_sparse_attention`, under the legacy
  schemas) and needs ``torch_npu`` (here: :func:`tests.doubles.npu_modules.fake_torch_npu`
  is installed with it);
* ``sgl_kernel_npu.attentions`` holds Python wrappers with the documented argument
  names, defaults and order, which call ``torch.ops.npu.<name>`` positionally and raise
  ``RuntimeError("<name> was not built for this SoC; ...")`` when the op is absent (an
  SoC such as A5, modelled by ``ops=`` leaving it out);
* the kernels check the current package's argument contract on top of the common one:
  ``sparse_size`` a multiple of 128 in [128, 512], the estimator's ``stride`` dividing it,
  fp16 with ``inner_precise`` 0 or 2 rejected (no fp16 high-precision specialization),
  layout TND rejected;
* there is no layer norm.

Every call is recorded (:class:`tests.doubles.npu_attentions.Recorder`).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterable, Iterator
from typing import Any

import torch

import tests.doubles.npu_sparse_attention  # noqa: F401 - adds the sparse kernels to FAKE_OPS
from tests.doubles.npu_attentions import Recorder, register_fake_ops
from tests.doubles.npu_modules import failing_import, fake_torch_npu_module, swapped_modules

#: The kernels the current package provides (on Ascend910B / Ascend910_93).
CURRENT_OPS = ("ada_block_sparse_attention", "sparse_block_estimate")


class ContractError(RuntimeError):
    """What a fake current-package kernel raises for arguments the real one rejects."""


def check_current_contract(name: str, args: tuple[Any, ...]) -> None:
    """The current package's checks (``args``: every schema argument, in order)."""
    layout = args[5] if name == "ada_block_sparse_attention" else args[4]
    if layout == "TND":
        raise ContractError(f"npu.{name}: layout TND is not exposed")
    size = args[6]
    if size % 128 or not 128 <= size <= 512:
        raise ContractError(f"npu.{name}: sparse_size {size} not a multiple of 128 in [128, 512]")
    if name == "sparse_block_estimate" and size % args[5]:
        raise ContractError(f"npu.{name}: stride {args[5]} does not divide sparse_size {size}")
    if name == "ada_block_sparse_attention":
        precise = args[11]
        if args[0].dtype == torch.float16 and precise in (0, 2):
            raise ContractError(
                f"npu.{name}: fp16 with inner_precise {precise} (high precision) is not supported"
            )


def _op(name: str) -> Any:
    try:
        return getattr(torch.ops.npu, name)
    except AttributeError:
        raise RuntimeError(
            f"{name} was not built for this SoC; the attention kernels of sgl_kernel_npu exist "
            "for Ascend910B and Ascend910_93 only (test double)"
        ) from None


def ada_block_sparse_attention(
    query,
    key,
    value,
    sparse_mask,
    sparse_count_table,
    input_layout="BNSD",
    sparse_size=128,
    num_heads=1,
    num_key_value_heads=1,
    scale_value=1.0,
    causal=True,
    inner_precise=1,
    pre_tokens=214748647,
    next_tokens=0,
    actual_seq_lengths=None,
    actual_seq_lengths_kv=None,
):
    """The documented wrapper: every argument, positionally, to torch.ops.npu."""
    return _op("ada_block_sparse_attention")(
        query,
        key,
        value,
        sparse_mask,
        sparse_count_table,
        input_layout,
        sparse_size,
        num_heads,
        num_key_value_heads,
        scale_value,
        causal,
        inner_precise,
        pre_tokens,
        next_tokens,
        actual_seq_lengths,
        actual_seq_lengths_kv,
    )


def sparse_block_estimate(
    query,
    key,
    actual_seq_lengths=None,
    actual_seq_lengths_kv=None,
    input_layout="BNSD",
    stride=8,
    sparse_size=128,
    num_heads=1,
    num_key_value_heads=1,
    scale_value=1.0,
    threshold=1.0,
    causal=True,
    keep_sink=True,
    keep_recent=True,
    row_sparse=1.0,
):
    """The documented wrapper: every argument, positionally, to torch.ops.npu."""
    return _op("sparse_block_estimate")(
        query,
        key,
        actual_seq_lengths,
        actual_seq_lengths_kv,
        input_layout,
        stride,
        sparse_size,
        num_heads,
        num_key_value_heads,
        scale_value,
        threshold,
        causal,
        keep_sink,
        keep_recent,
        row_sparse,
    )


def _modules(wrappers: bool) -> dict[str, types.ModuleType]:
    package = types.ModuleType("sgl_kernel_npu")
    package.__doc__ = "test double of the current sgl-kernel-npu wheel"
    package.__path__ = []  # type: ignore[attr-defined]  # a package: submodules import
    modules = {"sgl_kernel_npu": package}
    if wrappers:
        attentions = types.ModuleType("sgl_kernel_npu.attentions")
        attentions.ada_block_sparse_attention = ada_block_sparse_attention  # type: ignore[attr-defined]
        attentions.sparse_block_estimate = sparse_block_estimate  # type: ignore[attr-defined]
        package.attentions = attentions  # type: ignore[attr-defined]
        modules["sgl_kernel_npu.attentions"] = attentions
    return modules


@contextlib.contextmanager
def fake_sgl_kernel_npu(
    ops: Iterable[str] | None = None,
    raising: Iterable[str] = (),
    wrappers: bool = True,
) -> Iterator[Recorder]:
    """Install the fake ``sgl_kernel_npu`` (and a fake ``torch_npu``) for the block.

    Args:
        ops: which kernels the build has for this SoC (default: :data:`CURRENT_OPS`);
            ``[]`` models an SoC without them (A5): the wrappers import, and raise.
        raising: kernels that raise at call time.
        wrappers: False models a release whose ``sgl_kernel_npu.attentions`` lacks the
            wrappers (ditops then calls ``torch.ops.npu.*`` itself).
    """
    names = list(CURRENT_OPS) if ops is None else list(ops)
    recorder = Recorder()
    lib = register_fake_ops("npu", names, recorder, raising, check_current_contract)
    modules: dict[str, Any] = {**_modules(wrappers), "torch_npu": fake_torch_npu_module()}
    if not wrappers:
        modules["sgl_kernel_npu.attentions"] = None
    try:
        with swapped_modules(modules):
            yield recorder
    finally:
        lib._destroy()


@contextlib.contextmanager
def no_sgl_kernel_npu() -> Iterator[None]:
    """``import sgl_kernel_npu`` fails with ImportError for the block (not installed)."""
    with swapped_modules({"sgl_kernel_npu": None, "sgl_kernel_npu.attentions": None}):
        yield


@contextlib.contextmanager
def sgl_kernel_npu_without_torch_npu() -> Iterator[None]:
    """``sgl_kernel_npu`` is installed, but importing it fails: torch_npu is missing."""
    error = ModuleNotFoundError("No module named 'torch_npu'", name="torch_npu")
    with swapped_modules({"torch_npu": None}), failing_import("sgl_kernel_npu", error):
        yield
