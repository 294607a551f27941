"""Wan2.1/2.2 and the models built of its blocks (VACE, SkyReels-V2, ChronoEdit, Animate):
the declaration (``family``), fused block forwards (``blocks``), self-attention (``attention``)."""
