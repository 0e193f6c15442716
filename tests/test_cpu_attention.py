"""Decode-time attention on the CPU (`cpu_kernels.attention`) against its jnp reference, in fp32 and bf16; a
tree row bit-identical to the same token decoded alone; bad input refused. The kernel tests run once on this
CPU's widest vector unit and once, in a subprocess, on AVX2."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels import attention as ca
from cpu_kernels import matmul as cm
from s3djax import layers
from s3djax.cache import PrefixTreeMask
from tests.test_cpu_matmul import on_avx2

pytestmark = pytest.mark.skipif(cm.unavailable() is not None, reason=f"CPU kernel: {cm.unavailable()}")

# (B, T, H, KV, D, S, W): a decode step, a verify tree over two rows, Phi-3's head size 96, a ragged head
# size with a KV head per query head, a W-wide block (an autoregressive drafter's), and a 128-wide head.
SHAPES = [(1, 1, 9, 3, 64, 2048, 1), (2, 9, 9, 3, 64, 300, 9), (1, 5, 4, 4, 96, 40, 7), (1, 17, 8, 2, 13, 64, 17),
          (1, 3, 4, 2, 32, 50, 6), (1, 4, 2, 1, 128, 30, 4)]
attend = jax.jit(ca.attention, static_argnums=5)


def inputs(b, t, h, kv, d, s, w, dtype, seed=0, kv_dtype=None):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), x) for shape, x in
               (((b, t, h, d), dtype), ((b, s, kv, d), kv_dtype or dtype), ((b, s, kv, d), kv_dtype or dtype)))
    lengths = jnp.asarray(rng.integers(0, s - w, b), jnp.int32)
    tree = jnp.asarray(rng.random((b, t, w)) < 0.5) | jnp.eye(t, w, dtype=bool)[None]
    return q, k, v, lengths, tree


def check_all():
    """Every shape in fp32, bf16, and fp32 queries over a bf16 cache: close to the reference; and each tree row
    equal, bit for bit, to the same query decoded alone with its visible keys laid out contiguously, as `ar` would
    have them (S = 2048 and 300 rows span several pieces of keys)."""
    for dtype, kv_dtype, tol in ((jnp.float32, None, 2e-6), (jnp.bfloat16, None, 2e-2),
                                 (jnp.float32, jnp.bfloat16, 2e-6)):
        for shape in SHAPES:
            q, k, v, lengths, tree = inputs(*shape, dtype, kv_dtype=kv_dtype)
            scale = shape[4] ** -0.5
            got, want = attend(q, k, v, lengths, tree, scale), ca.reference(q, k, v, lengths, tree, scale)
            assert got.shape == q.shape and got.dtype == dtype
            if k.dtype == jnp.bfloat16:  # a cache held as its bits (s3djax.cache.BITS) reads the same
                bits = [jax.lax.bitcast_convert_type(x, jnp.uint16) for x in (k, v)]
                assert (np.asarray(attend(q, *bits, lengths, tree, scale), np.float32) == np.asarray(got, np.float32)).all()
            np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)
            for b in range(shape[0]):
                for t in range(shape[1]):
                    length = int(lengths[b])
                    seen = [length + j for j in range(shape[6]) if tree[b, t, j]]
                    order = np.r_[np.arange(length), seen, np.setdiff1d(np.arange(shape[5]), np.r_[:length, seen])]
                    alone = attend(q[b:b + 1, t:t + 1], k[b:b + 1, order], v[b:b + 1, order],
                                   jnp.asarray([length + len(seen) - 1], jnp.int32), jnp.ones((1, 1, 1), bool), scale)
                    assert (np.asarray(alone[0, 0], np.float32) == np.asarray(got[b, t], np.float32)).all(), \
                        (dtype, shape, b, t)


def test_kernel_against_reference_and_rows_alone():
    check_all()


def test_kernel_on_avx2():
    on_avx2("tests.test_cpu_attention")


def test_model_attention_takes_the_kernel_on_the_cpu_only():
    """`layers.attend` with a decode mask: the kernel on the CPU, XLA's blocks without it, and the CUDA
    lowering has no custom call."""
    q, k, v, lengths, tree = inputs(1, 3, 9, 3, 64, 300, 3, jnp.float32)
    mask = PrefixTreeMask(lengths, tree)
    on = jax.jit(lambda *a: layers.attend(*a, cpu_kernel=True))
    off = jax.jit(lambda *a: layers.attend(*a, cpu_kernel=False))
    assert ca.ATTENTION_TARGET in on.lower(q, k, v, mask).as_text()
    assert ca.ATTENTION_TARGET not in off.lower(q, k, v, mask).as_text()
    np.testing.assert_allclose(on(q, k, v, mask), off(q, k, v, mask), rtol=1e-5, atol=1e-5)
    cuda = on.trace(q, k, v, mask).lower(lowering_platforms=("cuda",)).as_text()
    assert ca.ATTENTION_TARGET not in cuda


def test_bad_input_is_a_clear_error():
    q, k, v, lengths, tree = inputs(1, 2, 4, 2, 16, 20, 2, jnp.float32)
    with pytest.raises(ValueError, match="CPU attention takes"):
        ca.attention(q.astype(jnp.float16), k, v, lengths, tree, 0.25)
    with pytest.raises(ValueError, match="CPU attention takes"):
        ca.attention(q[:, :, :3], k, v, lengths, tree, 0.25)  # 3 query heads over 2 KV heads


def test_handler_refuses_bad_buffers_without_crashing():
    """Past the wrapper's checks, the handler itself returns an error for mismatched buffers."""
    q, k, v, lengths, tree = inputs(1, 2, 4, 2, 16, 20, 2, jnp.float32)
    call = jax.ffi.ffi_call(ca.ATTENTION_TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    with pytest.raises(Exception, match="k and v must be"):
        jax.block_until_ready(call(q, k, v[:, :10], lengths, tree, scale=np.float32(0.25)))
    with pytest.raises(Exception, match="v must have k's dtype"):
        jax.block_until_ready(call(q, k.astype(jnp.bfloat16), v, lengths, tree, scale=np.float32(0.25)))
    with pytest.raises(Exception, match="wider than 16 vectors"):
        wide = jnp.ones((1, 1, 1, 1024)), jnp.ones((1, 4, 1, 1024))
        jax.block_until_ready(call(wide[0], wide[1], wide[1], lengths, tree[:, :1], scale=np.float32(0.1)))


def test_vmap_folds_into_one_call_that_equals_each_element_alone():
    """Both kernels vmapped (a batch of decoders, as the chi-square tests run thousands): one native call, not a
    loop of them, bit-identical to each element run alone, mapped operands or broadcast ones; a product whose
    weights are mapped maps them one at a time."""
    q, k, v, lengths, tree = (jnp.stack(xs) for xs in zip(*(inputs(2, 3, 4, 2, 16, 20, 3, jnp.float32, seed=s)
                                                              for s in range(3))))
    mapped = jax.jit(jax.vmap(lambda q, k, v, n, t: ca.attention(q, k, v, n, t, 0.25), (0, 0, 0, 0, None)))
    text = mapped.lower(q, k, v, lengths, tree[0]).as_text()
    assert text.count(ca.ATTENTION_TARGET) == 1 and "stablehlo.while" not in text
    got = mapped(q, k, v, lengths, tree[0])
    for i in range(3):
        assert (np.asarray(got[i]) == np.asarray(attend(q[i], k[i], v[i], lengths[i], tree[0], 0.25))).all()

    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 5, 64)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(2).standard_normal((3, 64, 40)), jnp.float32)
    product = jax.jit(lambda x, w: cm.matmul(x, w))
    for weights, axes in ((w[0], (0, None)), (w, (0, 0))):
        both = jax.jit(jax.vmap(lambda x, w: cm.matmul(x, w), axes))
        got = both(x, weights)
        text = both.lower(x, weights).as_text()
        assert text.count(cm.TARGET) == 1 and ("stablehlo.while" in text) == (weights.ndim == 3)
        for i in range(3):
            assert (np.asarray(got[i]) == np.asarray(product(x[i], weights if weights.ndim == 2 else weights[i]))).all()
