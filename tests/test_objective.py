"""The training objective computes exactly what the inference draft step computes, and nothing more."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s3djax import cache as kv
from s3djax import model
from s3djax.skip_plan import SkipPlan
from s3djax.speculative import tree as trees
from s3djax.speculative.draft_params import init_draft
from s3djax.speculative.drafters.s3d import S3DDrafter
from train import objectives as ob
from tiny import LLAMA, PHI3, random_correction, random_params
from train.trainable import assemble, init_trainable

PLAN = SkipPlan.skipping_layers(4, [1, 2])
T, GAMMA = 24, 3
ANCHORS = jnp.array([[5, 11, 17]])


def setup(config, seed=0):
    params = random_params(config, seed)
    draft = init_draft(params, config, PLAN, lora_rank=2, key=jax.random.key(seed + 1))
    keys = iter(jax.random.split(jax.random.key(seed + 2), 100))
    draft = jax.tree.map(lambda a: a + 0.3 * jax.random.normal(next(keys), a.shape), draft)
    tokens = jax.random.randint(jax.random.key(seed + 3), (1, T), 0, config.vocab_size)
    return params, draft, tokens


# Jitted: op by op, each of these tests compiled 500-600 small programs, most of its time.
@functools.partial(jax.jit, static_argnames="config")
def training_blocks(params, draft, tokens, config, context=None):
    if context is None:
        context = model.forward_sequence(params, tokens, config=config)[1]
    return ob.block_logits(params, draft, context, tokens, ANCHORS, config=config, plan=PLAN, gamma=GAMMA)


@functools.partial(jax.jit, static_argnames=("i", "config"))
def committed(params, tokens, i, config):
    """Inference's cache with the prefix t_0..t_{i-1} committed (t_i is the last token, not yet cached)."""
    zero = jnp.zeros((1,), jnp.int32)
    return model.Decoder(config).apply({"params": params}, tokens[:, :i], jnp.arange(i)[None],
                                       kv.init_cache(config, 1, 64), zero, kv.causal_mask(zero, i, 64))[1]


@pytest.mark.parametrize("config", [LLAMA, PHI3], ids=["llama", "phi3"])
def test_training_blocks_equal_the_inference_draft_step(config):
    params, draft, tokens = setup(config)
    got = training_blocks(params, draft, tokens, config)
    drafter = S3DDrafter(config, PLAN, trees.resolve("chain", GAMMA), GAMMA)
    block_logits = jax.jit(drafter.block_logits)
    for a, i in enumerate(np.asarray(ANCHORS[0]).tolist()):
        want, _ = block_logits(params, draft, committed(params, tokens, i, config), jnp.array([i]), tokens[:, i])
        np.testing.assert_allclose(got[0, a], want[0], atol=2e-5)


def test_a_corrected_chain_drafts_the_training_objectives_argmax(monkeypatch):
    # Teacher forcing with the chain's own tokens as data, training's corrected logits pick that chain.
    # Inference rescores only the uncorrected top candidates; here they are the whole vocabulary.
    from s3djax.sampling import Sampling
    from s3djax.speculative.drafters import s3d

    monkeypatch.setattr(s3d, "CANDIDATES", LLAMA.vocab_size)

    params, draft, tokens = setup(LLAMA)
    draft = {**draft, "correction": random_correction(LLAMA, 7)}
    drafter = S3DDrafter(LLAMA, PLAN, trees.resolve("chain", GAMMA), GAMMA)
    changed = 0
    greedy_draft = jax.jit(lambda *args: drafter.draft(*args, (), None, Sampling())[0])
    for a, i in enumerate(np.asarray(ANCHORS[0]).tolist()):
        chain = greedy_draft(params, draft, committed(params, tokens, i, LLAMA), jnp.array([i]), tokens[:, i])[0]
        forced = tokens.at[0, i + 1:i + GAMMA].set(chain[:GAMMA - 1])
        got = jnp.argmax(training_blocks(params, draft, forced, LLAMA)[0, a], axis=-1)
        np.testing.assert_array_equal(got, chain)
        plain = {k: v for k, v in draft.items() if k != "correction"}
        changed += int((jnp.argmax(training_blocks(params, plain, forced, LLAMA)[0, a], -1) != got).any())
    assert changed  # the correction moved some choice


def test_a_block_sees_nothing_at_or_after_its_anchor():
    params, draft, tokens = setup(LLAMA)
    context_of = jax.jit(lambda t: model.forward_sequence(params, t, config=LLAMA)[1])
    context = context_of(tokens)
    base = training_blocks(params, draft, tokens, LLAMA, context)
    first = int(ANCHORS[0, 0])
    # Later data tokens change the context K/V after the first anchor, but not its block.
    later = tokens.at[:, first + 1:].set((tokens[:, first + 1:] + 1) % LLAMA.vocab_size)
    moved = training_blocks(params, draft, later, LLAMA, context_of(later))
    np.testing.assert_array_equal(moved[0, 0], base[0, 0])
    assert not np.allclose(moved[0, 1], base[0, 1])  # the next block's context did change
    # The context's own K/V at the anchor slot is never read: the block brings its own for t_i.
    def poke(slot):
        return [{k: v.at[:, slot].add(3.0) for k, v in layer.items()} for layer in context]
    np.testing.assert_array_equal(training_blocks(params, draft, tokens, LLAMA, poke(first))[0, 0], base[0, 0])
    assert not np.allclose(training_blocks(params, draft, tokens, LLAMA, poke(first - 1))[0, 0], base[0, 0])


def test_anchors_are_distinct_and_only_where_the_next_token_is_trained():
    mask = np.zeros((3, 40), np.uint8)
    mask[0, 10:30] = 1
    mask[1, :] = 1
    mask[2, 35:] = 1
    lengths = jnp.array([40, 25, 37])
    anchors, valid = ob.sample_anchors(jax.random.key(0), jnp.asarray(mask), lengths, 12)
    anchors, valid = np.asarray(anchors), np.asarray(valid)
    for row in range(3):
        a = anchors[row][valid[row]]
        assert len(set(a)) == len(a)
        assert all(1 <= i and i + 1 < lengths[row] and mask[row, i + 1] for i in a)
    assert valid[0].all() and valid[1].all() and valid[2].sum() == 2  # row 2: only 34 and 35 (next token trained, inside the length)


@pytest.mark.parametrize("config", [LLAMA, PHI3], ids=["llama", "phi3"])
def test_a_full_depth_draft_is_always_right_at_depth_1(config):
    # With every layer kept and zero adapters, block position 0 is the target's own next-token prediction.
    params, _, tokens = setup(config)
    draft = init_draft(params, config, SkipPlan.full(4), lora_rank=2)
    batch = {"tokens": tokens, "loss_mask": jnp.ones((1, T), jnp.uint8), "lengths": jnp.array([T])}
    _, sums = ob.s3d_loss(params, draft, batch, jax.random.key(1), config=config, plan=SkipPlan.full(4), gamma=GAMMA,
                          num_anchors=8, target="greedy")
    assert sums["depth_count"][0] == 8 and sums["depth_correct"][0] == 8


@pytest.mark.parametrize("mode", ["lossless", "full"])
def test_gradients_reach_only_what_the_mode_trains(mode):
    plan = SkipPlan.parse("1.attn,2", 4)
    params, _, tokens = setup(LLAMA)
    trainable = init_trainable(params, LLAMA, plan, mode, lora_rank=2, key=jax.random.key(0))
    if mode == "lossless":
        assert set(trainable) == {"mask_embed", "lora"}
        assert [sorted(x) for x in trainable["lora"]] == [["down", "gate", "k", "o", "q", "up", "v"],
                                                         ["down", "gate", "up"], [], ["down", "gate", "k", "o", "q", "up", "v"]]
        trainable["lora"] = jax.tree.map(lambda a: a + 0.1, trainable["lora"])  # B = 0 would zero A's gradient
    else:  # the kept sub-layers only: layer 1's attention and all of layer 2 stay frozen
        assert sorted(trainable["layers"]) == ["0", "1", "3"]
        assert sorted(trainable["layers"]["1"]) == ["mlp", "mlp_norm"]
    batch = {"tokens": tokens, "loss_mask": jnp.ones((1, T), jnp.uint8), "lengths": jnp.array([T])}

    def loss(t, frozen):
        p, d = assemble(t, frozen)
        return ob.s3d_loss(p, d, batch, jax.random.key(2), config=LLAMA, plan=plan, gamma=GAMMA, num_anchors=6,
                           lm_weight=1.0 if mode == "full" else 0.0)[0]

    grads, frozen_grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(trainable, params)
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))
    if mode == "lossless":  # the target only feeds the draft; it is never handed to the optimizer
        assert jax.tree.structure(grads) == jax.tree.structure(trainable)
    else:  # the skipped layer influences the loss (through the next-token term) yet is not trained
        assert float(jnp.abs(frozen_grads["layers_2"]["attn"]["q"]).max()) > 0 and "2" not in grads["layers"]
