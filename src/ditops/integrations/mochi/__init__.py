"""Mochi: the declaration (``family``) and its fused forwards and processor (``forwards``)."""
