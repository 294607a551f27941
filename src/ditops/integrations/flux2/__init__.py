"""FLUX.2: the declaration (``family``) and its fused forwards and processors (``forwards``)."""
