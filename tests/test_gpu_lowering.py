"""Every method's jitted steps, and the Pallas kernels in them, lower for CUDA from this CPU-only
install, so a GPU run meets no lowering error.

The kernels lower on the Triton backend (Pallas's GPU lowering, Triton's power-of-two shape rules
included) at the registry models' decode shapes. Shapes are `jax.ShapeDtypeStruct`s and params
abstract, so a 7B model costs no memory. What is left to a GPU is compiling the Triton IR itself.
"""

import functools
import itertools
import re

import jax
import jax.numpy as jnp
import pytest

from benchmarks import h100_compile
from benchmarks.h100_compile import abstract_build, new_tokens, projections
from pallas_kernels.int8_matmul import int8_matmul
from pallas_kernels.tree_attention import tree_attention
from s3djax import methods, registry
from s3djax.speculative.drafters.s3d import PAPER_GAMMA

S = jax.ShapeDtypeStruct
MODELS = ("smollm2-135m", "llama-2-7b", "phi-3-mini-4k")  # head dims 64, 128 and 96
# New tokens per step: AR's one, a chain's gamma + 1, and each named tree's nodes, root included.
NEW_TOKENS = new_tokens()
CACHES = h100_compile.CACHES
PROMPT = 512  # int8 rows past one 128-row tile, as in a prefill
DTYPES = pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "fp32"])


def lower(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def triton_kernels(text: str) -> set[str]:
    """The names of the Triton kernels that a lowered module calls."""
    return set(re.findall(r'@__gpu\$xla\.gpu\.triton\(.*?name = "(\w+)"', text))


def assert_every_case_lowers(cases, lower_case) -> None:
    """Lowers every case, then fails naming each one that raised: one run reports every failing shape."""
    failures = []
    for case in cases:
        try:
            lower_case(*case)
        except Exception as e:  # any error fails the test; collected so that the other cases still run
            failures.append(f"{case}: {type(e).__name__}: {str(e)[:500]}")
    assert not failures, f"{len(failures)} cases fail to lower:\n" + "\n".join(failures)


def lower_steps(decoder, params) -> tuple[str, str]:
    """The CUDA lowerings of a decoder's jitted start (a 64-token prompt bucket) and decode steps."""
    prompt, lengths, key = S((1, 64), jnp.int32), S((1,), jnp.int32), jax.random.key(0)
    state = jax.eval_shape(decoder.start, params, prompt, lengths, key)
    return lower(decoder.start, params, prompt, lengths, key), lower(decoder.decode, params, state, jnp.int32(10))


@pytest.mark.parametrize("method", methods.METHODS)
def test_the_start_and_decode_steps_lower_for_cuda(smollm2, method):
    built = methods.build(method, smollm2, max_cache_len=2048, gamma=PAPER_GAMMA)  # a GPU's default
    assert "stablehlo.while" in lower_steps(built.decoder, built.params)[1]  # one loop, on device


@pytest.mark.parametrize("name", MODELS)
@DTYPES
def test_tree_attention_lowers_with_triton_at_every_decode_shape(name, dtype):
    c = registry.entries()[name].config()

    def lower_case(t, s):
        q = S((1, t, c.num_heads, c.head_dim), dtype)
        cache, new = S((1, s, c.num_kv_heads, c.head_dim), dtype), S((1, t, c.num_kv_heads, c.head_dim), dtype)
        text = lower(functools.partial(tree_attention, backend="triton"), q, cache, cache, S((1,), jnp.int32), new,
                     new, S((1, t, t), jnp.bool_))
        assert triton_kernels(text) == {"tree_attention"}

    assert_every_case_lowers(itertools.product(NEW_TOKENS, CACHES), lower_case)


@pytest.mark.parametrize("name", MODELS)
@DTYPES
def test_int8_matmul_lowers_with_triton_at_every_projection(name, dtype):
    shapes = projections(name)

    def lower_case(m, shape):
        k, n = shape
        text = lower(functools.partial(int8_matmul, backend="triton"), S((m, k), dtype), S((k, n), jnp.int8),
                     S((n,), jnp.float32))
        assert triton_kernels(text) == {"int8_matmul"}

    assert_every_case_lowers(itertools.product((*NEW_TOKENS, PROMPT), shapes), lower_case)


def test_the_default_backend_follows_the_platform_lowered_for():
    traced = jax.jit(int8_matmul).trace(S((5, 576), jnp.bfloat16), S((576, 192), jnp.int8), S((192,), jnp.float32))
    assert triton_kernels(traced.lower(lowering_platforms=("cuda",)).as_text()) == {"int8_matmul"}
    assert triton_kernels(traced.lower(lowering_platforms=("cpu",)).as_text()) == set()  # the interpreter


@pytest.mark.parametrize("name, method, quantization, tree", [
    ("smollm2-135m", "ar", None, "chain"), ("smollm2-135m", "s3d", "int8", "chain"),
    ("smollm2-135m", "s3d", None, "dynamic-16"),  # a tree mask that changes every step
    ("phi-3-mini-4k", "ar", "int8", "chain"), ("phi-3-mini-4k", "s3d", None, "chain")])
def test_steps_with_the_pallas_kernels_lower_for_cuda_with_triton(name, method, quantization, tree):
    start, decode = lower_steps(*abstract_build(name, method, quantization, tree))
    matmul = {"int8_matmul"} if quantization else set()
    # AR's step of one token a row normalizes in the Pallas kernel too; several rows (drafts, verification) in XLA
    assert triton_kernels(decode) == {"tree_attention"} | matmul | ({"rms_norm"} if method == "ar" else set())
    assert triton_kernels(start) == matmul  # the prefill attends under a dense causal mask, through XLA


def test_drafting_inside_the_verify_pass_lowers_for_cuda_with_triton():
    # 25 rows per verify at gamma 4 (the chain and every node's branch), through the same tree-attention kernel
    start, decode = lower_steps(*abstract_build("smollm2-135m", "s3d", None, "chain", in_verify="on"))
    assert triton_kernels(decode) == {"tree_attention"}
