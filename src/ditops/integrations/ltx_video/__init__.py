"""LTX-Video: the declaration (``family``) and its fused forward and processor (``forwards``)."""
