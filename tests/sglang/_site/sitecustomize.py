"""Loaded at start-up by every Python process of the sglang test environment (the test
run and the worker processes sglang spawns), through PYTHONPATH set in conftest.py.

The registry's torchvision 0.28.0 wheel links CUDA: beside the CPU torch its C++ ops never
load, and its meta registrations then fail on import with ``operator torchvision::nms does
not exist``. sglang imports torchvision unconditionally (transformers' image utilities).
Defining the two op schemas those registrations look up lets the pure-Python parts load;
nothing here calls them. No installed file is edited.
"""

import importlib.util

if importlib.util.find_spec("torchvision") is not None:
    import torch

    try:
        torch._C._dispatch_find_schema_or_throw("torchvision::nms", "")
    except RuntimeError:
        _lib = torch.library.Library("torchvision", "DEF")  # kept alive: module global
        _lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _lib.define(
            "qnms(Tensor dets, Tensor scores, Tensor scores_scale, float iou_threshold) -> Tensor"
        )
