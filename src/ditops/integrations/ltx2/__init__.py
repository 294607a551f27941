"""LTX-2: the declaration (``family``) and its fused forward and processor (``forwards``)."""
