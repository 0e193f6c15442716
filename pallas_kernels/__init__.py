"""Pallas kernels (tree attention, int8 matmul), each beside a jnp reference; selected by config."""
