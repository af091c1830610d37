"""Triton kernels. Importing this package never requires Triton; each module
reports why it cannot run (no Triton, no GPU and no interpreter)."""
