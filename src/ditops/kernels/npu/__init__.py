"""Ascend NPU paths built on the kernels torch_npu ships.

The modules here never import torch_npu themselves: the layers hand them the
``torch_npu`` functions after the backend probe succeeded.
"""
