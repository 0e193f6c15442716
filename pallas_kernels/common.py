"""What both kernels share: the choice of backend and Triton's masked loads.

A kernel runs on one of BACKENDS: "triton" (compiled for a CUDA or ROCm GPU) or "interpret" (Pallas's
interpreter, plain XLA ops that run anywhere, for tests on the CPU). By default the backend follows
the platform the computation is lowered for, not the process's default device, so a step lowered for
CUDA from a CPU-only process (ahead-of-time, or a CI check of the GPU lowering) gets the Triton kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

BACKENDS = ("triton", "interpret")


def pallas_call(kernel, backend: str | None, *, num_warps: int, num_stages: int, **kwargs):
    """`pl.pallas_call(kernel, **kwargs)` on `backend`; None: Triton where the call is lowered for a
    GPU and the interpreter elsewhere. num_warps and num_stages are Triton's launch parameters."""
    if backend not in (None, *BACKENDS):
        raise ValueError(f"unknown Pallas backend {backend!r}; choose from {', '.join(BACKENDS)}")
    # Explicit Triton params: without them Pallas lowers for a GPU with Mosaic GPU (the default of
    # jax_pallas_use_mosaic_gpu), whose shared memory these kernels' blocks overflow.
    triton = pl.pallas_call(kernel, compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
                            **kwargs)
    interpret = pl.pallas_call(kernel, interpret=True, **kwargs)
    if backend is not None:
        return triton if backend == "triton" else interpret
    # Both are traced; lowering keeps only the branch of the platform it lowers for.
    return lambda *args: jax.lax.platform_dependent(*args, cuda=triton, rocm=triton, default=interpret)


def masked_load(ref, mask):
    """ref's block with masked-off lanes zero; mask is None (load it all) or broadcasts to the block."""
    if mask is None:
        return ref[...]
    # Masked-off lanes come back undefined (NaN in interpret mode), hence the select to zero; the
    # `other=` argument would need a literal of the ref's exact dtype, which is less portable.
    return jnp.where(mask, plgpu.load(ref, mask=mask), 0)


def masked_store(ref, value, mask):
    """Write value to ref's block where mask (None: everywhere) is true; masked-off lanes keep what they held."""
    if mask is None:
        ref[...] = value
    else:
        plgpu.store(ref, value, mask=mask)
