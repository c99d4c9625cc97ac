"""Kernels (Triton/Helion) with pure-torch references."""
