"""CUDA kernels of this package (compiled by nvcc, run by the native launcher)."""
