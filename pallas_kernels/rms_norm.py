"""RMSNorm of a step's rows, after the residual add where there is one, in one kernel.

On a GPU XLA made the norm two launches (the reduction, then the normalized vector) and the residual add before it a
third wherever a GEMM did not take it as its epilogue; a decode step of a small model is bound by its launches
(docs/gpu-compile.md). A program takes one row: it adds the residual, rounds the sum to the rows' dtype as XLA
does, and normalizes it as Hugging Face does (in fp32, cast back, then scaled). A row whose width is no power of two
is read with a block that overhangs it, masked.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import common


def reference(x, scale, eps: float, residual=None):
    """normed, or (x + residual, normed of that) where `residual` is given: x [..., D], scale [D]."""
    if residual is not None:
        x = x + residual
    x32 = x.astype(jnp.float32)
    sum_squares = jax.lax.platform_dependent(x32 * x32, cpu=row_sums, default=lambda s: jnp.sum(s, -1, keepdims=True))
    normed = scale * (x32 * jax.lax.rsqrt(sum_squares / x.shape[-1] + eps)).astype(x.dtype)
    return normed if residual is None else (x, normed)


def row_sums(x):
    """x [..., D] summed over D, [..., 1], by halves in a fixed tree of elementwise adds (D padded with zeros to a
    power of two): every row's bits its own. XLA:CPU sums a reduction otherwise for 8 rows and more than for fewer
    (at SmolLM2's width, 2026-12-02), so a verify pass's rows would not be normed as the same rows alone."""
    width = 1 << max(0, (x.shape[-1] - 1).bit_length())
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x


def _kernel(*refs, eps: float, width: int, add: bool):
    x_ref, *rest = refs
    r_ref, scale_ref, *outs = rest if add else (None, *rest)
    columns = None if width == x_ref.shape[-1] else jax.lax.broadcasted_iota(jnp.int32, x_ref.shape, len(x_ref.shape) - 1) < width
    x = common.masked_load(x_ref, columns)
    if add:
        x = (x.astype(jnp.float32) + common.masked_load(r_ref, columns).astype(jnp.float32)).astype(x_ref.dtype)
        common.masked_store(outs[0], x, columns)
    x32 = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) / width + eps)
    scale = common.masked_load(scale_ref, columns).astype(jnp.float32)
    normed = (scale * (x32 * inv).astype(x_ref.dtype).astype(jnp.float32)).astype(outs[-1].dtype)
    common.masked_store(outs[-1], normed, columns)


@functools.partial(jax.jit, static_argnames=("eps", "backend"))
def rms_norm(x, scale, residual=None, *, eps: float, backend: str | None = None):
    """`reference` as one Pallas kernel a row. backend: as `common.pallas_call`'s."""
    shape, d = x.shape, x.shape[-1]
    rows = x.reshape(-1, d)
    m, d_p = rows.shape[0], max(16, 1 << (d - 1).bit_length())
    add = residual is not None
    out_dtype = jnp.result_type(scale.dtype, x.dtype)
    row = pl.BlockSpec((1, d_p), lambda i: (i, 0))
    args = [rows] + ([residual.reshape(-1, d)] if add else []) + [scale.reshape(1, d)]
    in_specs = [row] * (1 + add) + [pl.BlockSpec((1, d_p), lambda i: (0, 0))]
    out_shape = [jax.ShapeDtypeStruct((m, d), x.dtype)] * add + [jax.ShapeDtypeStruct((m, d), out_dtype)]
    outs = common.pallas_call(functools.partial(_kernel, eps=eps, width=d, add=add), backend, num_warps=4, num_stages=1,
                              out_shape=out_shape, grid=(m,), in_specs=in_specs, out_specs=[row] * len(out_shape),
                              name="rms_norm")(*args)
    outs = [o.reshape(shape) for o in outs]
    return (outs[0], outs[1]) if add else outs[0]
