"""The ops: one file per op (or family of ops sharing one call), each holding the op's
meaning, its argument checks (``prepare``), its paths and their reasons. Kernels live in
:mod:`ditops.kernels`; the modules users put in models, in :mod:`ditops.layers`."""
