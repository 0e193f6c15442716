"""Native CPU kernels reached from jitted JAX through XLA's FFI (C++ beside each Python wrapper and reference)."""
