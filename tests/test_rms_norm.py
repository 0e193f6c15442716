"""The Pallas RMSNorm kernel (with and without the residual add before it) against its jnp reference, in interpret
mode on the CPU, and its lowering for CUDA with Triton at the registry models' widths."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.rms_norm import reference, rms_norm
from s3djax import registry

# bf16: the sum of squares is added in another order than XLA's, so a normalized value may round the other way.
TOLERANCE = {jnp.float32: 1e-6, jnp.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(1, 1, 576), (2, 5, 64), (1, 3, 96)])  # SmolLM2's width, a power of two, Phi-3's head
@pytest.mark.parametrize("add", [False, True], ids=["norm", "add-norm"])
def test_the_kernel_computes_the_reference(dtype, shape, add):
    keys = jax.random.split(jax.random.key(shape[-1]), 3)
    x, residual = (3 * jax.random.normal(k, shape, dtype) for k in keys[:2])
    scale = (1 + 0.1 * jax.random.normal(keys[2], shape[-1:], jnp.float32)).astype(dtype)
    got = rms_norm(x, scale, residual if add else None, eps=1e-5, backend="interpret")
    want = reference(x, scale, 1e-5, residual if add else None)
    got, want = (got, want) if add else ((got,), (want,))
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=TOLERANCE[dtype],
                                   atol=TOLERANCE[dtype])
    if add:  # the sum is the add XLA does, rounded to the rows' dtype: exactly
        np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(x + residual, np.float32))


@pytest.mark.parametrize("name", ["smollm2-135m", "llama-2-7b", "phi-3-mini-4k"])
def test_it_lowers_with_triton_at_every_model_width(name):
    d = registry.entries()[name].config().hidden_size
    x, scale = jax.ShapeDtypeStruct((1, 5, d), jnp.bfloat16), jax.ShapeDtypeStruct((d,), jnp.bfloat16)
    for residual in (None, x):
        text = jax.jit(functools.partial(rms_norm, eps=1e-5, backend="triton")).trace(x, scale, residual).lower(
            lowering_platforms=("cuda",)).as_text()
        assert 'name = "rms_norm"' in text


def test_a_decoder_with_the_pallas_norms_decodes_as_with_xla():
    # The GPU's decode setting on the CPU (interpret mode, the CPU kernels off): AR's one-token steps normalize in the
    # kernel, each residual add deferred to the next norm, and decode the tokens XLA's norms decode.
    from s3djax.decode import ARDecoder, Runner
    from tiny import LLAMA, random_params

    config = LLAMA.replace(cpu_kernel=False)
    params = random_params(config, 3)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    decoders = {impl: ARDecoder(config.replace(attention=impl), 64, eos_ids=()) for impl in ("xla", "pallas")}
    runs = {impl: Runner(d, params).generate(prompt, 12) for impl, d in decoders.items()}
    assert runs["pallas"].tokens == runs["xla"].tokens and len(runs["xla"].tokens) == 12
    for impl, d in decoders.items():  # the kernel is in the pallas decoder's step, and only there
        state = jax.eval_shape(d.start, params, jnp.zeros((1, 8), jnp.int32), jnp.full((1,), 8, jnp.int32), jax.random.key(0))
        step = str(jax.make_jaxpr(d.decode)(params, state, jnp.int32(4)))
        assert ("name=rms_norm" in step) == (impl == "pallas")


@pytest.mark.parametrize("width", [576, 64, 96])  # SmolLM2's, a power of two, another
def test_on_the_cpu_each_row_is_normed_as_it_is_alone(width):
    """A verify pass's rows (a tree's, drafting inside the verify pass, a batch's) normed as the same rows one at a
    time, bit for bit, whatever their count: XLA:CPU's reduction summed 8 rows and more otherwise than fewer, so the target's
    rows of a 9-row verify pass differed from `ar`'s in their last bits (W8A8 turned that into other tokens)."""
    keys = jax.random.split(jax.random.key(width), 3)
    x, residual = (3 * jax.random.normal(k, (1, 40, width), jnp.float32) for k in keys[:2])
    scale = 1 + 0.1 * jax.random.normal(keys[2], (width,), jnp.float32)
    norm = jax.jit(lambda x, r: reference(x, scale, 1e-5, r))
    alone = [np.asarray(norm(x[:, i:i + 1], residual[:, i:i + 1])[1]) for i in range(40)]
    for rows in (2, 8, 9, 17, 40):
        together = np.asarray(norm(x[:, :rows], residual[:, :rows])[1])
        assert all((together[:, i:i + 1] == alone[i]).all() for i in range(rows)), rows
    np.testing.assert_allclose(together, np.asarray(x + residual) * jax.lax.rsqrt(
        jnp.mean(jnp.square(x + residual), -1, keepdims=True) + 1e-5) * np.asarray(scale), rtol=2e-6)
