"""FLUX.1: the declaration (``family``) and its fused forwards and processor (``forwards``)."""
