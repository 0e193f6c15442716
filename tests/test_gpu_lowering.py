"""Every method's jitted steps lower for CUDA from this CPU-only install, so a GPU run meets no
lowering error (XLA attention here; the Pallas kernels' CUDA lowering is issue 22's)."""

import jax
import jax.numpy as jnp
import pytest

from s3djax import methods


@pytest.mark.parametrize("method", methods.METHODS)
def test_the_start_and_decode_steps_lower_for_cuda(smollm2, method):
    built = methods.build(method, smollm2, max_cache_len=2048)
    prompt, lengths, key = jnp.zeros((1, 64), jnp.int32), jnp.array([40], jnp.int32), jax.random.key(0)
    state = jax.eval_shape(built.decoder.start, built.params, prompt, lengths, key)
    lower = lambda step, *args: jax.jit(step).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    lower(built.decoder.start, built.params, prompt, lengths, key)
    assert "stablehlo.while" in lower(built.decoder.decode, built.params, state, jnp.int32(10))  # one loop, on device
