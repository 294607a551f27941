"""Triton kernels for GPUs (cuda, hip, xpu).

The modules here import triton at top level: import them only after the Triton backend
probe succeeded (never from ``import ditops``).
"""
