"""Waiting for a device while the tuner times (:mod:`ditops.core.tune`).

Timing a call on an accelerator needs the device to finish its queued work before and
after. The device waited for is the call's tensors' own (``cuda:1`` on a machine whose
current device is ``cuda:0``), never the one a device kind names: under the device-kind
test doubles (``ditops.force_device_kind``) CPU tensors take "cuda" paths on a machine
that may have no accelerator at all, and there nothing is waited for.
"""

from __future__ import annotations

import torch


def sync_device(device: torch.device) -> None:
    """Wait for ``device``'s queued work; nothing for host devices (cpu, meta)."""
    if device.type in ("cpu", "meta"):
        return
    backend = getattr(torch, device.type, None)
    wait = getattr(backend, "synchronize", None)
    if callable(wait):  # torch.cuda / torch.xpu / torch.npu (torch_npu) take the device
        wait(device)
    else:
        torch.accelerator.synchronize(device)


def device_for_kind(kind: str) -> torch.device | None:
    """The accelerator a kernel launched for ``kind`` without tensors at hand runs on:
    the current accelerator when it is of that kind, else None (nothing to wait for)."""
    if kind == "cpu" or not torch.accelerator.is_available():
        return None
    current = torch.accelerator.current_accelerator()
    if current is None or current.type != kind:
        return None
    return torch.device(kind, torch.accelerator.current_device_index())
