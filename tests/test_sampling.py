"""The fast sampler against its definition: top-k / top-p found among candidates equal the full sort's, on
SmolLM2's own logits and on wide and tied ones, on both paths; the inverse-CDF draw has the right
distribution and never draws what was cut."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from s3djax import sampling
from s3djax.sampling import Sampling, draw, draw_from_probs, draws, process_logits, process_logits_reference
from s3djax.tokenizer import encode_prompt

SETTINGS = [Sampling(0.7, 0, 0.9), Sampling(1.0, 50, 1.0), Sampling(1.0, 0, 0.95), Sampling(0.7, 40, 0.9),
            Sampling(1.3, 0, 0.99), Sampling(0.5, 1000, 0.8)]


@functools.partial(jax.jit, static_argnames="s")
def both(logits, s):
    return process_logits(logits, s), process_logits_reference(logits, s)


def nucleus_sizes(logits, s):
    return np.isfinite(np.asarray(process_logits_reference(logits, s))).sum(-1)


def assert_same(logits, s):
    """The same logits kept, bit for bit, but where the mass before a token is top_p within float32 rounding: there
    the candidates' normalizer, summed in another order than the sorted one, may fall on the other side."""
    fast, reference = (np.asarray(x) for x in both(logits, s))
    differ = np.isfinite(fast) != np.isfinite(reference)
    np.testing.assert_array_equal(np.where(differ, 0, fast), np.where(differ, 0, reference))
    if differ.any():
        x = np.asarray(logits, np.float64) / s.temperature
        if s.top_k:
            x = np.where(x < -np.sort(-x, -1)[..., s.top_k - 1:s.top_k], -np.inf, x)
        p = np.exp(x - x.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        for row in zip(*np.nonzero(differ)):
            before = p[row[:-1]][x[row[:-1]] > x[row]].sum()
            assert abs(before - s.top_p) < 1e-5, (row, before)


@pytest.fixture(scope="module")
def smollm2_logits(smollm2):
    """SmolLM2's next-token logits [1, T, V] after each position of a chat prompt and its greedy answer."""
    from s3djax.decode import ARDecoder, Runner
    from s3djax.model import forward_sequence, Decoder

    ids = encode_prompt(smollm2.tokenizer, "Write a short poem about the sea, then explain it.", True)
    ids = ids + Runner(ARDecoder(smollm2.config, 256, eos_ids=()), smollm2.params).generate(ids, 48).tokens
    hidden, _ = forward_sequence(smollm2.params, jnp.asarray([ids], jnp.int32), config=smollm2.config)
    return Decoder(smollm2.config).apply({"params": smollm2.params}, hidden, method="logits")


@pytest.mark.parametrize("s", SETTINGS, ids=str)
def test_smollm2_logits_cut_as_the_full_sort_cuts(smollm2_logits, s):
    assert_same(smollm2_logits, s)


def test_both_paths_are_taken_on_smollm2(smollm2_logits):
    # At temperature 1.3 and top-p 0.99 some nuclei are wider than the candidates and some are not.
    sizes = nucleus_sizes(smollm2_logits, Sampling(1.3, 0, 0.99))
    assert (sizes <= sampling.CANDIDATES).any() and (sizes > sampling.CANDIDATES).any()


@pytest.mark.parametrize("scale", [1.0, 4.0, 12.0])
@pytest.mark.parametrize("s", SETTINGS, ids=str)
def test_wide_and_peaked_logits_cut_as_the_full_sort_cuts(s, scale):
    logits = jax.random.normal(jax.random.key(int(scale)), (3, 5, 49152)) * scale
    assert_same(logits, s)


@pytest.mark.parametrize("s", [Sampling(1.0, 3, 1.0), Sampling(1.0, 0, 0.5), Sampling(1.0, 2, 0.7)], ids=str)
def test_ties_at_the_cut_are_kept_as_the_full_sort_keeps_them(monkeypatch, s):
    monkeypatch.setattr(sampling, "CANDIDATES", 2)  # the ties straddle the candidates' end
    logits = jnp.log(jnp.asarray([[0.2, 0.2, 0.2, 0.2, 0.1, 0.1], [0.3, 0.1, 0.3, 0.1, 0.1, 0.1]]))
    assert_same(logits, s)


@pytest.mark.parametrize("candidates", [1, 3, 8])
def test_any_number_of_candidates_cuts_the_same(monkeypatch, candidates):
    monkeypatch.setattr(sampling, "CANDIDATES", candidates)
    logits = jax.random.normal(jax.random.key(candidates), (16, 40)) * 2
    for s in SETTINGS[:4]:
        assert_same(logits, s)


@pytest.mark.parametrize("top_p", [0.3, 0.5, 0.75, 0.9])
def test_the_halving_keeps_what_the_sort_keeps_with_ties_signed_zeros_and_cut_tokens(top_p):
    # Rows whose nucleus the candidates cannot hold are cut by halving (`bisected_threshold`) instead of a sort.
    logits = jnp.asarray([[0.0, -0.0, 0.0, -1.0, -jnp.inf, -jnp.inf], [2.0, -3.0, 2.0, 1.0, 1.0, -jnp.inf],
                          [-1e30, 5.0, -2.5, -2.5, -2.5, 4.0]])
    reference = process_logits_reference(logits, Sampling(1.0, 0, top_p))
    threshold = sampling.bisected_threshold(logits, top_p)
    np.testing.assert_array_equal(np.isfinite(np.where(logits < threshold, -jnp.inf, logits)), np.isfinite(reference))


def chi_square(draws_, probs):
    counts = np.bincount(np.asarray(draws_).ravel(), minlength=probs.size)
    assert counts[probs == 0].sum() == 0, "a token of probability 0 was drawn"
    keep = probs > 0
    return stats.chisquare(counts[keep], probs[keep] / probs[keep].sum() * counts.sum()).pvalue


def test_draw_follows_the_softmax_and_never_draws_a_cut_token():
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.full(50, 0.3))
    probs[rng.choice(50, 20, replace=False)] = 0.0  # cut tokens, some at the ends of their blocks
    probs[[0, 49]] = 0.0
    logits = jnp.log(jnp.asarray(np.tile(probs, (40_000, 1)), jnp.float32))
    assert chi_square(jax.jit(draw)(jax.random.key(1), logits), probs) > 1e-3
    assert chi_square(jax.jit(draw_from_probs)(jax.random.key(2), jnp.exp(logits) * 3.0), probs) > 1e-3


def test_draw_over_a_whole_vocabulary_matches_the_blocks_mass():
    # SmolLM2's width: which block (of about sqrt(V)) a draw falls in, against the blocks' mass.
    logits = jax.random.normal(jax.random.key(3), (49152,)) * 2
    tokens = np.asarray(jax.jit(lambda k: draw(k, jnp.broadcast_to(logits, (20_000, 49152))))(jax.random.key(4)))
    probs = np.asarray(jax.nn.softmax(logits), np.float64)
    width = 222  # isqrt(49151) + 1
    block_probs = np.bincount(np.arange(49152) // width, weights=probs)
    assert chi_square(tokens // width, block_probs) > 1e-3


def test_a_draw_is_seeded():
    logits = jax.random.normal(jax.random.key(0), (4, 1000))
    a, b, c = (np.asarray(draw(jax.random.key(k), logits)) for k in (5, 5, 6))
    assert (a == b).all() and (a != c).any()


def test_one_draw_scores_its_token_and_several_are_distinct():
    logq = jax.nn.log_softmax(jax.random.normal(jax.random.key(0), (3, 2, 30)))
    score, index = draws(jax.random.key(1), logq, 1)
    np.testing.assert_array_equal(score, jnp.take_along_axis(logq, index, -1))
    _, index = draws(jax.random.key(1), logq, 5)
    assert all(len(set(row)) == 5 for row in np.asarray(index).reshape(-1, 5).tolist())
