"""CogVideoX 1.0 and 1.5: the declaration (``family``), fused forwards (``forwards``)."""
