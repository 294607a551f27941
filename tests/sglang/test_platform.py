"""ditops' platform classes answer as the built-in platform of their kind does (the runtime
and sglang's kernels branch on these answers), as an out-of-tree platform."""

from __future__ import annotations

import pytest
import torch
from sglang.kernels.ops.diffusion.common import platform as kernel_platform

from ditops.integrations.sglang import platform as plugin
from tests.sglang.helpers import current_platform


@pytest.mark.parametrize(
    ("kind", "predicates", "backend", "library_key"),
    [
        ("cpu", (True, False, False), "gloo", "CUDA"),
        ("cuda", (False, True, False), "nccl", "CUDA"),
        ("npu", (False, False, True), "hccl", "PrivateUse1"),
    ],
)
def test_each_kind_keeps_its_built_in_answers(kind, predicates, backend, library_key) -> None:
    cls = getattr(plugin, plugin.KINDS[kind][2])
    assert issubclass(cls, plugin.builtin_class(kind))
    instance = cls()
    assert instance.is_out_of_tree() and instance.get_dispatch_key_name() == kind
    assert (instance.is_cpu(), instance.is_cuda(), instance.is_npu()) == predicates
    assert instance.get_torch_distributed_backend_str() == backend
    assert instance.get_torch_library_dispatch_key() == library_key
    assert instance.supports_distributed_device_id() == (kind == "cuda")
    if kind != "npu":  # torch names the "npu" device only once torch_npu is imported
        assert instance.get_device(1) == (
            torch.device("cpu") if kind == "cpu" else torch.device("cuda", 1)
        )
    with current_platform(instance):  # what sglang's kernel modules pick by
        assert kernel_platform.platform_key() == kind
