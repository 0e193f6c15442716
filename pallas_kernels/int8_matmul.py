"""Weight-only int8 matmul (W8A16) for decode: y = (x @ values) * scale, with M from 1 to about 128 rows.

At decode the weight dominates the bytes moved, so it is read once, as int8, and never widened in
memory: each program converts its [block_k, block_n] tile to the activation dtype in registers and
feeds the dot, accumulating in fp32. The per-output-channel scale commutes with the sum over K, so
it is applied once, to the accumulator, before the cast to x's dtype.

Layout: x [M, K] (leading dims flattened), values [K, N] row-major, scale [N]. The grid is
(M blocks, N blocks); a program owns one [block_m, block_n] output tile and walks K in a
fori_loop (Triton runs grid programs concurrently, so a K grid axis could not carry the
accumulator). Tiles are powers of two of at least 16, as Triton's load and dot need. A dimension
they do not divide (M below 16, or K, N like 100 or 77) is handled by masked loads and stores of
the ragged last tile rather than padding, so neither the weight nor x is ever copied; shapes that
divide, i.e. every real model's K and N, are lowered without masks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import common


def reference(x, values, scale):
    """Plain jnp: x [..., K] (bf16 or fp32), values int8 [K, N], scale [N] fp32 (per output channel).

    Returns (x @ values) * scale computed in fp32, cast to x.dtype, shape [..., N].
    """
    y = jnp.matmul(x.astype(jnp.float32), values.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def _block(dim: int, cap: int) -> int:
    # The largest power of two <= cap that divides dim; if that is below Triton's 16, one tile of the
    # next power of two (still <= cap), its ragged tail masked.
    b = min(cap, dim & -dim)
    return b if b >= 16 else min(cap, max(16, pl.next_power_of_2(dim)))


def choose_blocks(m: int, k: int, n: int) -> tuple[int, int, int]:
    """(block_m, block_n, block_k) for x [m, k] @ values [k, n].

    block_m covers every row (up to 128) so the weight is streamed once. block_n starts at 128 and
    halves (down to 32) until there are about 128 programs: with few rows the kernel is bound by
    weight bandwidth, and a 4096-wide layer in 128-column tiles would occupy only 32 SMs. block_k
    keeps the weight and activation tiles near 16K elements.
    """
    block_m = min(128, max(16, pl.next_power_of_2(m)))
    block_n = _block(n, 128)
    while block_n > 32 and pl.cdiv(m, block_m) * pl.cdiv(n, block_n) < 128:
        block_n //= 2
    block_k = _block(k, min(512, 16384 // max(block_m, block_n)))
    return block_m, block_n, block_k


def _kernel(x_ref, w_ref, s_ref, o_ref, *, m: int, k: int, n: int, block_k: int):
    block_m, block_n = o_ref.shape
    i, j = pl.program_id(0), pl.program_id(1)
    # Masks exist only for a dimension the tile does not divide (None otherwise, and free).
    rows = _inside(i, block_m, m)
    cols = _inside(j, block_n, n)
    dtype = x_ref.dtype

    def body(t, acc):
        span = pl.ds(t * block_k, block_k)
        inner = _inside(t, block_k, k)
        x = _load(x_ref.at[:, span], rows, inner)
        w = _load(w_ref.at[span, :], inner, cols).astype(dtype)                # dequantize in registers
        # HIGHEST: Triton would otherwise run fp32 dots in TF32; it changes nothing for bf16.
        return acc + jax.lax.dot(x, w, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, pl.cdiv(k, block_k), body, jnp.zeros((block_m, block_n), jnp.float32))
    out = (acc * _load(s_ref, cols)[None, :]).astype(o_ref.dtype)
    mask = _both(rows, cols)
    if mask is None:
        o_ref[...] = out
    else:
        plgpu.store(o_ref, out, mask=mask)


def _inside(block, size: int, dim: int):
    if dim % size == 0:
        return None
    return block * size + jax.lax.broadcasted_iota(jnp.int32, (size,), 0) < dim


def _both(rows, cols):
    if rows is None and cols is None:
        return None
    if rows is None:
        return cols[None, :]
    return rows[:, None] if cols is None else rows[:, None] & cols[None, :]


def _load(ref, rows, cols=None):
    return common.masked_load(ref, _both(rows, cols) if len(ref.shape) == 2 else rows)


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "backend"))
def int8_matmul(x, values, scale, *, block_m: int | None = None, block_n: int | None = None,
                block_k: int | None = None, backend: str | None = None):
    """The Pallas kernel with `reference`'s contract. Leading dims of x are flattened into M rows.
    Blocks default to `choose_blocks`; each must be a power of two >= 16. backend: one of
    `common.BACKENDS`, or None for the one that fits the platform lowered for (see `common`)."""
    *lead, k = x.shape
    n = values.shape[1]
    if values.shape != (k, n) or values.dtype != jnp.int8 or scale.shape != (n,):
        raise ValueError(f"want x [..., K], int8 values [K, N], scale [N]; got {x.shape}, "
                         f"{values.dtype}{list(values.shape)}, {scale.shape}")
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    auto = choose_blocks(m, k, n)
    block_m, block_n, block_k = block_m or auto[0], block_n or auto[1], block_k or auto[2]
    for b in (block_m, block_n, block_k):
        assert b >= 16 and b & (b - 1) == 0, f"blocks must be powers of two >= 16 (Triton), got {b}"
    kernel = functools.partial(_kernel, m=m, k=k, n=n, block_k=block_k)
    # The K extent of a block is the whole, unpadded K: the kernel's loop slices it, masking a ragged tail.
    out = common.pallas_call(
        kernel, backend, num_warps=4, num_stages=3,
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        grid=(pl.cdiv(m, block_m), pl.cdiv(n, block_n)),
        in_specs=[pl.BlockSpec((block_m, k), lambda i, j: (i, 0)),
                  pl.BlockSpec((k, block_n), lambda i, j: (0, j)),
                  pl.BlockSpec((block_n,), lambda i, j: (j,))],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        name="int8_matmul",
    )(x2, values, scale.astype(jnp.float32))
    return out.reshape(*lead, n)
