"""The Pallas tree-attention kernel against its jnp reference (interpret mode on CPU, native on a GPU)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.tree_attention import choose_blocks, reference, tree_attention
from s3djax import cache as kv
from s3djax.speculative import tree as trees
from s3djax.speculative.tree import TreeSpec

# On a GPU, fp32 matmuls run as TF32 (JAX's default precision there, in XLA and in Triton alike): a 10-bit
# mantissa, so kernel and reference part by up to 1e-3 (seen on an H100: at most 9.8e-4).
ON_GPU = jax.default_backend() == "gpu"
FP32 = 2e-3 if ON_GPU else 2e-5
TOLERANCE = {jnp.float32: FP32, jnp.bfloat16: 2e-2}  # bf16: inputs and output rounded, math in fp32


def inputs(b, t, heads, kv_heads, d, s, dtype, seed, tree=None):
    ks = jax.random.split(jax.random.key(seed), 7)
    q = jax.random.normal(ks[0], (b, t, heads, d), dtype)
    kc, vc = (jax.random.normal(k, (b, s, kv_heads, d), dtype) for k in ks[1:3])
    kn, vn = (jax.random.normal(k, (b, t, kv_heads, d), dtype) for k in ks[3:5])
    if tree is None:  # a random mask that, like every real one, lets a node see itself
        tree = jax.random.bernoulli(ks[5], 0.4, (b, t, t)) | jnp.eye(t, dtype=bool)[None]
    return q, kc, vc, kn, vn, tree


def check(b, t, heads, kv_heads, d, s, lengths, dtype=jnp.float32, seed=0, tree=None, **kw):
    q, kc, vc, kn, vn, tree = inputs(b, t, heads, kv_heads, d, s, dtype, seed, tree)
    lengths = jnp.asarray(lengths, jnp.int32)
    got = tree_attention(q, kc, vc, lengths, kn, vn, tree, **kw)
    want = reference(q, kc, vc, lengths, kn, vn, tree)
    assert got.shape == want.shape and got.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])


class TestTreeAttention:
    """Run in interpret mode on CPU; on a GPU the same class runs the native kernel."""

    # Every query count and GQA ratio, and rows (t * group) from 1 to 192 on both sides of choose_blocks'
    # 64-row switch: the full grid took twice the interpreter's time and reaches no other code path.
    @pytest.mark.parametrize("t, group", [(1, 1), (1, 4), (4, 3), (16, 1), (16, 4), (64, 3)])
    def test_query_counts_and_gqa_ratios(self, t, group):
        s = 300  # not a multiple of the 128-key block; lengths cover 0, mid-block, and the last slot that fits
        check(2, t, 2 * group, 2, 64, s, [0, s - t] if t < s else [0, 0], seed=t * 10 + group)
        check(1, t, 2 * group, 2, 64, s, [129], seed=t + group)

    @pytest.mark.parametrize("d", [64, 96, 128])
    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
    def test_head_dims_and_dtypes(self, d, dtype):
        # 96 (Phi-3) is padded to 128 with the cache's columns past 96 masked; the interpreter pads
        # the overhung cache with NaN, so a column that is not masked shows.
        check(2, 5, 9, 3, d, 516, [17, 511], dtype=dtype, seed=d)

    @pytest.mark.parametrize("name", ["tree-8", "tree-16", "tree-64"])
    def test_real_tree_masks(self, name):
        spec = trees.resolve(name, 4)
        tree = jnp.broadcast_to(jnp.asarray(spec.ancestors), (2,) + spec.ancestors.shape)
        check(2, spec.num_nodes, 9, 3, 64, 1024, [1, 700], tree=tree)
        chain = TreeSpec.chain(4)
        check(1, chain.num_nodes, 9, 3, 64, 256, [100], tree=jnp.asarray(chain.ancestors)[None])

    @pytest.mark.parametrize("block_k, splits", [(16, 1), (16, 5), (64, 3), (128, 16)])
    def test_every_block_and_split_choice(self, block_k, splits):
        check(1, 4, 4, 2, 64, 200, [199 - 4], block_k=block_k, splits=splits)
        check(1, 4, 4, 2, 64, 200, [3], block_k=block_k, splits=splits)

    def test_every_output_element_is_written(self):
        q, kc, vc, kn, vn, tree = inputs(1, 8, 4, 2, 64, 512, jnp.float32, 3)
        # Lengths that leave most splits without a block: they must still write their (empty) partials.
        for length in (0, 5, 300):
            out = tree_attention(q, kc, vc, jnp.asarray([length]), kn, vn, tree, splits=8, poison=True)
            assert np.isfinite(np.asarray(out)).all()
            np.testing.assert_allclose(out, reference(q, kc, vc, jnp.asarray([length]), kn, vn, tree), atol=FP32,
                                       rtol=FP32)

    @pytest.mark.parametrize("d, dtype", [(64, jnp.float32), (96, jnp.bfloat16)], ids=["d64-fp32", "d96-bf16"])
    def test_given_slots_it_writes_the_new_rows_where_the_cache_write_would(self, d, dtype):
        # On a GPU the cache write is then no launch of its own. Row 1's slot runs past the buffer's end: its rows
        # move back to fit, as dynamic_update_slice moves them (a runner never lets that happen).
        q, kc, vc, kn, vn, tree = inputs(2, 5, 9, 3, d, 300, dtype, 7)
        lengths, slots = jnp.asarray([17, 211], jnp.int32), jnp.asarray([17, 298], jnp.int32)
        out, k2, v2 = tree_attention(q, kc, vc, lengths, kn, vn, tree, slots)
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(reference(q, kc, vc, lengths, kn, vn, tree), np.float32),
                                   atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
        for got, cache, new in ((k2, kc, kn), (v2, vc, vn)):
            want = kv.put_rows(cache, new, slots)  # the model's cache write off the kernel
            assert got.dtype == cache.dtype and not np.array_equal(want, cache)
            np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))

    def test_a_new_prefix_length_compiles_nothing(self, compiles):
        q, kc, vc, kn, vn, tree = inputs(1, 4, 4, 2, 64, 256, jnp.float32, 4)
        tree_attention(q, kc, vc, jnp.asarray([10]), kn, vn, tree).block_until_ready()
        warm = compiles()
        for length in (0, 64, 200, 252):
            tree_attention(q, kc, vc, jnp.asarray([length]), kn, vn, tree).block_until_ready()
        assert compiles() == warm


@pytest.mark.parametrize("d", [64, 96])
def test_the_cache_reaches_the_kernel_as_is_and_the_new_rows_in_one_operand(d):
    # Traced for the GPU path (nothing is lowered): the kernel reads the cache in place whatever its head dim, and
    # the queries, new keys and new values padded into one operand (on a GPU each pad or copy is a launch).
    q, cache, new = (jax.ShapeDtypeStruct((1, t, heads, d), jnp.bfloat16) for t, heads in ((5, 9), (516, 3), (5, 3)))
    trace = jax.make_jaxpr(lambda *a: tree_attention(*a, backend="triton"))
    lengths, tree = jax.ShapeDtypeStruct((1,), jnp.int32), jax.ShapeDtypeStruct((1, 5, 5), jnp.bool_)
    inner = trace(q, cache, cache, lengths, new, new, tree).jaxpr.eqns[0].params["jaxpr"]                # the jit
    [call] = [e for e in inner.eqns if e.primitive.name == "pallas_call"]
    assert call.invars[2:4] == inner.invars[1:3]
    assert call.invars[1] is call.invars[4] is call.invars[5] and call.invars[1].aval.shape == (1, 3, 16 + 2 * 16, 64 if d == 64 else 128)


def test_block_choice_fits_the_buffer_and_splits_only_a_long_cache():
    for s in (16, 100, 516, 2048, 8192):
        block_k, splits = choose_blocks(s, 64)
        assert block_k <= s and block_k & (block_k - 1) == 0 and splits >= 1
    # SmolLM2's default 2,048-slot cache in one program a KV head (no merge to launch); 8,192 slots, or a 7B's heads of
    # 128, across several.
    assert choose_blocks(2048, 3, 64)[1] == 1 and choose_blocks(8192, 3, 64)[1] > 1 and choose_blocks(2048, 1, 128)[1] > 1


@pytest.mark.parametrize("tree_name, gamma", [("chain", 4), ("tree-16", 4)])
def test_the_engine_is_lossless_with_pallas_attention(tree_name, gamma):
    from s3djax.decode import ARDecoder, Runner
    from s3djax.skip_plan import SkipPlan
    from s3djax.speculative.draft_params import init_draft
    from s3djax.speculative.drafters.s3d import S3DDrafter
    from s3djax.speculative.loop import SpecDecoder
    from tiny import LLAMA, random_params

    params = random_params(LLAMA, 1)
    plan = SkipPlan.parse("1-2", 4)
    draft = init_draft(params, LLAMA, plan)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    outputs = {}
    for impl in ("xla", "pallas"):
        config = dataclasses.replace(LLAMA, attention=impl)
        ar = ARDecoder(config, 96, eos_ids=())
        spec = SpecDecoder.create(ar, S3DDrafter(config, plan, trees.resolve(tree_name, gamma), gamma))
        outputs[impl, "ar"] = Runner(ar, params).generate(prompt, 30).tokens
        outputs[impl, "s3d"] = Runner(spec, (params, draft)).generate(prompt, 30).tokens
    assert len(set(map(tuple, outputs.values()))) == 1, outputs


@pytest.mark.parametrize("lengths", [[3, 140], [290, 250], [0, 128], [295, 1]])
def test_xla_attention_over_the_occupied_prefix_equals_the_dense_mask(lengths):
    # 300 slots: key blocks of 128, the last one read from slot 172 with the overlap masked.
    from s3djax.cache import PrefixTreeMask
    from s3djax.layers import attend

    q, kc, vc, _, _, tree = inputs(2, 5, 6, 2, 16, 300, jnp.float32, seed=3)
    mask = PrefixTreeMask(jnp.asarray(lengths, jnp.int32), tree)
    exact = FP32 if ON_GPU else 1e-6  # on a CPU the two differ only in the order of their sums
    np.testing.assert_allclose(attend(q, kc, vc, mask), attend(q, kc, vc, mask.dense(300)), atol=exact, rtol=exact)
    # An autoregressive drafter's block: its last two nodes' rows over the whole five-slot scratch tree.
    wide = PrefixTreeMask(mask.lengths, tree[:, 3:])
    np.testing.assert_allclose(attend(q[:, 3:], kc, vc, wide), attend(q[:, 3:], kc, vc, wide.dense(300)), atol=exact,
                               rtol=exact)


def test_attention_defaults_to_the_kernel_on_a_gpu_alone(monkeypatch):
    from s3djax import config

    assert config.default_attention() == "xla"  # here: the kernel would only interpret
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert config.default_attention() == "pallas"
