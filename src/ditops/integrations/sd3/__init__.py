"""Stable Diffusion 3 / 3.5 (``SD3Transformer2DModel``): fused adaLN chain and q/k RMSNorms."""
