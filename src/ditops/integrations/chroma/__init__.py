"""Chroma (``ChromaTransformer2DModel``): FLUX's blocks with modulations from the approximator."""
