"""Our own kernels, grouped by where they run. Kernels never import layers."""
