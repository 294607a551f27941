"""What ``ditops bench`` and ``ditops tune`` accept as ``--device``, in one line."""

from __future__ import annotations

import torch


def device_problem(text: str | None) -> str | None:
    """What is wrong with ``--device TEXT`` (empty, not a torch device, one without data,
    one this machine lacks), in one line, or None when it can run and be timed on."""
    if text is None:  # not given: the default device
        return None
    if not text.strip():  # '' would silently mean the default
        return "--device is empty; give a device (cpu, cuda, cuda:1, ...)"
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError, TypeError) as exc:
        return f"--device {text} is not a torch device ({_first_line(exc)})"
    if device.type == "meta":
        return "--device meta holds no data: nothing runs or can be timed there; give cpu or a GPU"
    try:
        torch.empty(1, device=device).add_(1)
    except (RuntimeError, AssertionError, ValueError) as exc:
        return f"--device {text} is not usable here ({_first_line(exc)})"
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
