"""Loaded at start-up by every Python process of the sglang test environment (the test
run and the worker processes sglang spawns), through PYTHONPATH set in conftest.py.

sglang 0.5.21's pins: the registry's torchvision 0.28.0 wheel links CUDA: beside the CPU
torch its C++ ops never load, and its meta registrations then fail on import with
``operator torchvision::nms does not exist``. sglang imports torchvision unconditionally
(transformers' image utilities). Defining the two op schemas those registrations look
up lets the pure-Python parts load; nothing here calls them. Where torchvision's own
library loads (sglang 0.5.23's torchvision beside its torch), it defines them itself and
this does nothing (defining them first would abort its load). No installed file is edited.
"""

import importlib.util

_spec = importlib.util.find_spec("torchvision")
if _spec is not None and _spec.submodule_search_locations:
    import glob
    import os

    import torch

    try:
        torch._C._dispatch_find_schema_or_throw("torchvision::nms", "")
    except RuntimeError:
        _libs = glob.glob(os.path.join(_spec.submodule_search_locations[0], "_C*.so"))
        try:
            for _path in _libs:
                torch.ops.load_library(_path)
            torch._C._dispatch_find_schema_or_throw("torchvision::nms", "")
        except (OSError, RuntimeError):
            _lib = torch.library.Library("torchvision", "DEF")  # kept alive: module global
            _lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            _lib.define(
                "qnms(Tensor dets, Tensor scores, Tensor scores_scale, float iou_threshold)"
                " -> Tensor"
            )
