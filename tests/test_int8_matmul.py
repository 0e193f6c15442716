"""The Pallas int8 (W8A16) matmul against its jnp reference, and the reference against float64 NumPy
(interpret mode on CPU, native on a GPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.int8_matmul import choose_blocks, int8_matmul, reference

# fp32: only the summation order differs. bf16: the same, plus the output's rounding to 8 bits.
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}
DTYPES = pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])


def inputs(shape, n, dtype, seed=0):
    """x [*shape] normal, values over the whole int8 range, scales that keep outputs near unit size."""
    rng = np.random.default_rng(seed)
    k = shape[-1]
    x = jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
    values = jnp.asarray(rng.integers(-128, 128, (k, n)), jnp.int8)
    scale = jnp.asarray(rng.uniform(0.5, 2.0, n) / (64 * np.sqrt(k)), jnp.float32)
    return x, values, scale


def assert_close(got, want, dtype):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    tol = TOLERANCE[dtype]
    # Relative to the output's size, so that entries that cancel to near zero do not demand more.
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


def check(shape, n, dtype, seed=0, **blocks):
    x, values, scale = inputs(shape, n, dtype, seed)
    got = int8_matmul(x, values, scale, **blocks)
    want = reference(x, values, scale)
    assert got.shape == want.shape == (*shape[:-1], n) and got.dtype == want.dtype == dtype
    assert np.isfinite(np.asarray(got, np.float32)).all()
    assert_close(got, want, dtype)


@DTYPES
@pytest.mark.parametrize("shape, n", [((3, 576), 192), ((2, 5, 100), 77)])
def test_reference_is_dequantize_then_matmul(shape, n, dtype):
    x, values, scale = inputs(shape, n, dtype, seed=1)
    weight = np.asarray(values, np.float64) * np.asarray(scale, np.float64)                # [K, N]
    want = np.asarray(x.astype(jnp.float32), np.float64) @ weight
    got = reference(x, values, scale)
    assert got.shape == want.shape and got.dtype == dtype
    assert_close(got, want, dtype)


class TestInt8Matmul:
    """Run in interpret mode on CPU; on a GPU the same class runs the native kernel."""

    @DTYPES
    @pytest.mark.parametrize("m, k, n", [
        (1, 576, 192),    # SmolLM2 AR step
        (4, 64, 1536),    # draft block; M below the 16-row tile
        (17, 96, 200),    # M past a power of two; N=200 has no power-of-two divisor >= 16: ragged N tile
        (128, 100, 77),   # verify-sized M; K and N both ragged
    ])
    def test_default_blocks(self, m, k, n, dtype):
        check((m, k), n, dtype, seed=m)

    @pytest.mark.parametrize("m, k, n, block_m, block_n, block_k", [
        (4, 576, 192, 16, 64, 128),     # K=576 in 128-blocks: a masked K tail on a real shape
        (17, 100, 77, 16, 16, 32),      # two M tiles, five N tiles, four K steps, all ragged
        (128, 64, 1536, 64, 256, 16),   # two M tiles, many K steps, nothing ragged
    ])
    def test_explicit_blocks(self, m, k, n, block_m, block_n, block_k):
        check((m, k), n, jnp.float32, seed=n, block_m=block_m, block_n=block_n, block_k=block_k)

    @DTYPES
    def test_leading_dims(self, dtype):
        check((2, 3, 96), 200, dtype, seed=7)                                                # [B, T, K]

    def test_weight_reaches_the_kernel_as_is(self):
        # Traced for the GPU path (nothing is lowered): the int8 weight goes straight into the
        # pallas_call, with no dequantized, padded or copied version built around it.
        x, values, scale = inputs((5, 100), 77, jnp.bfloat16)
        jaxpr = jax.make_jaxpr(lambda x, v, s: int8_matmul(x, v, s, backend="triton"))(x, values, scale).jaxpr
        inner = jaxpr.eqns[0].params["jaxpr"]                                                # the jit
        [call] = [e for e in inner.eqns if e.primitive.name == "pallas_call"]
        assert call.invars[1] is inner.invars[1]
        assert {e.primitive.name for e in inner.eqns} <= {"pallas_call", "reshape", "convert_element_type"}


@pytest.mark.parametrize("k, n", [(576, 192), (576, 1536), (1536, 576), (576, 49152),
                                  (4096, 4096), (4096, 11008), (11008, 4096), (4096, 32000)])
@pytest.mark.parametrize("m", [1, 16, 128])
def test_real_shapes_need_no_weight_masks(m, k, n):
    """SmolLM2 and Llama-2-7B projections: K and N blocks are powers of two >= 16 that divide them, so
    weight loads are unmasked; one M tile holds every row (only the cheap x and output accesses mask)."""
    block_m, block_n, block_k = choose_blocks(m, k, n)
    for b in (block_m, block_n, block_k):
        assert b >= 16 and b & (b - 1) == 0
    assert n % block_n == 0 and k % block_k == 0 and block_m >= m
