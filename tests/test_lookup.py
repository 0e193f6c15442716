"""Prompt lookup, alone and as the source of S3D's chain where the last tokens match: the n-gram match on
known histories, the switch rule, and greedy output equal to `ar` on random and real models."""

import jax.numpy as jnp
import numpy as np
import pytest

from s3djax import cache as kv
from s3djax import defaults, methods
from s3djax.sampling import Sampling
from s3djax.decode import ARDecoder, Runner
from s3djax.skip_plan import SkipPlan
from s3djax.speculative.draft_params import init_draft
from s3djax.speculative.drafters.base import Drafter
from s3djax.speculative.drafters.lookup import LookupDrafter, WithLookup, propose
from s3djax.speculative.drafters.kangaroo import KangarooDrafter, init_adapter
from s3djax.speculative.drafters.s3d import S3DDrafter
from s3djax.speculative.drafters.self_spec import AdaptiveThreshold, SelfSpecDrafter
from s3djax.speculative.loop import SpecDecoder
from s3djax.speculative.tree import TreeSpec
from tests.tiny import LLAMA, PHI3, random_params


def proposed(history, end, ngram=3, depth=4):
    tokens, valid, _ = propose(jnp.asarray([history], jnp.int32), jnp.asarray([end], jnp.int32), ngram, depth)
    return [int(t) for t, ok in zip(tokens[0], valid[0]) if ok]


def test_the_longest_n_gram_wins_over_a_later_shorter_one():
    #            0  1  2  3  4  5  6  7  8  9  10 11
    history = [5, 6, 7, 1, 2, 9, 4, 7, 8, 3, 6, 7]
    # "6 7" ends at slot 2 (then 1 2 9 4); "7" alone also ends at slot 7 (then 8 3 6 7), later but shorter.
    assert proposed(history, 11) == [1, 2, 9, 4]
    assert proposed(history, 11, ngram=1) == [8, 3, 6, 7]


def test_the_latest_match_wins_and_the_draft_stops_at_the_known_history():
    history = [3, 4, 1, 3, 4, 2, 8, 3, 4, 0, 0, 0]  # slots past end 8 are not written yet
    # "3 4" ends at slots 1 and 4 before the end; slot 4 is later: 2 8 3 4, all known.
    assert proposed(history, 8) == [2, 8, 3, 4]
    # A match ending one slot before the end can only propose the end's own token.
    assert proposed([1, 1, 1, 9, 9, 9], 5, ngram=3, depth=3) == [9]


def test_no_match_proposes_nothing():
    assert proposed([1, 2, 3, 4, 5, 0, 0], 4) == []
    assert proposed([7, 0, 0], 0) == []  # one token: nothing before it


def test_rows_match_independently():
    history = jnp.asarray([[1, 2, 1, 2, 0, 0], [3, 3, 3, 3, 3, 3]], jnp.int32)
    tokens, valid, _ = propose(history, jnp.asarray([2, 5], jnp.int32), 2, 3)
    assert tokens[0].tolist()[:1] == [2] and valid[0].tolist() == [True, True, False]
    assert valid[1].tolist() == [True, False, False] and int(tokens[1, 0]) == 3


def repeating_case(config, seed):
    """Random weights, a prompt that repeats itself (so lookup finds matches from the first step), its AR
    decoder and AR's 48 greedy tokens."""
    rng = np.random.default_rng(seed)
    params = random_params(config, seed)
    phrase = rng.integers(0, config.vocab_size, 6).tolist()
    prompt = phrase * 3 + phrase[:2]
    ar = ARDecoder(config, 96, eos_ids=())
    return params, prompt, ar, Runner(ar, params).generate(prompt, 48).tokens


@pytest.mark.parametrize("config, seed, depth, ngram", [(LLAMA, 0, 4, 3), (PHI3, 1, 6, 2), (LLAMA, 2, 1, 1)],
                         ids=["llama-d4", "phi3-d6", "llama-d1"])
def test_greedy_lookup_is_ar_token_for_token(config, seed, depth, ngram):
    params, prompt, ar, expected = repeating_case(config, seed)
    decoder = SpecDecoder.create(ar, LookupDrafter(config, TreeSpec.chain(depth), ngram))
    result = Runner(decoder, (params, {})).generate(prompt, 48)
    assert result.tokens == expected
    assert result.stats["mean_drafted"] > 0 and result.stats["verify_steps"] < 48


def test_smollm2_lookup_equals_ar_and_commits_more_than_one_token_a_step(smollm2):
    from s3djax.tokenizer import encode_prompt

    text = "Repeat this sentence exactly three times: the quick brown fox jumps over the lazy dog."
    ids = encode_prompt(smollm2.tokenizer, text, chat_template=True)
    ar = methods.build("ar", smollm2, max_cache_len=192)
    expected = Runner(ar.decoder, ar.params).generate(ids, 48).tokens
    built = methods.build("lookup", smollm2, max_cache_len=192)
    assert built.decoder.drafter.tree.depth == defaults.fallback("depth", "lookup") and built.decoder.drafter.ngram == 3
    result = Runner(built.decoder, built.params).generate(ids, 48)
    assert result.tokens == expected
    assert result.stats["mean_accepted_tokens"] > 1.5


class Fixed(Drafter):
    """Drafts 7s, the chain of depth 2: what lookup replaces or leaves."""
    tree, gamma, config = TreeSpec.chain(2), 2, LLAMA

    def draft(self, params, draft, cache, length, last, state, key, sampling):
        return jnp.full((last.shape[0], 2), 7, jnp.int32), jnp.ones((last.shape[0], 2), bool), None, cache, state


@pytest.mark.parametrize("history, end, switch, expected", [
    ([4, 5, 6, 4, 5, 0, 0], 4, 2, [6, 4]),   # "4 5" occurred before: lookup's chain
    ([4, 5, 6, 4, 5, 0, 0], 4, 3, [7, 7]),   # only 2 tokens match, 3 are needed: the drafter's
    ([1, 2, 3, 1, 0, 0, 0], 3, 1, [2, 3]),   # one token is enough at switch 1
    ([3, 1, 1, 0, 0, 0, 0], 2, 1, [7, 7]),   # "1" at slot 1 is followed by the last token, then the unknown: the drafter's
], ids=["bigram", "too-short", "unigram", "partial"])
def test_a_step_takes_lookups_chain_only_where_enough_tokens_match_and_it_knows_the_chain(history, end, switch,
                                                                                         expected):
    drafter = WithLookup(Fixed(), switch=switch, ngram=3)
    prompt = jnp.asarray([history[:end]], jnp.int32)
    state = (drafter.inner.init_state(None, None, None), jnp.zeros((1, len(history)), jnp.int32).at[
        0, :end].set(prompt[0]), jnp.int32(0), jnp.int32(switch))
    at, last = jnp.asarray([end], jnp.int32), jnp.asarray([history[end]], jnp.int32)
    free = drafter.free(state, at, last).tolist()  # what the pause gate reads before the step
    nodes, valid, _, _, state = drafter.draft(None, None, None, at, last, state, None, Sampling())
    assert nodes[0].tolist() == expected and valid[0].all() and free == [expected != [7, 7]]
    # The run's count of steps lookup drafted (`stats`) takes this one where lookup's chain was used.
    assert drafter.stats(state) == {"lookup_steps": int(expected != [7, 7])}


def test_in_a_batch_each_row_takes_its_own_source():
    """Row 0 matches and takes lookup's chain; row 1 does not, so the model drafts (for both) and row 1 keeps it."""
    drafter = WithLookup(Fixed(), switch=2, ngram=3)
    history = jnp.asarray([[4, 5, 6, 4, 5, 0, 0], [4, 5, 6, 1, 5, 0, 0]], jnp.int32)
    end = jnp.asarray([4, 4], jnp.int32)
    state = ((), history.at[:, 4:].set(0), jnp.int32(0), jnp.int32(2))
    nodes, valid, _, _, _ = drafter.draft(None, None, None, end, history[:, 4], state, None, Sampling())
    assert nodes.tolist() == [[6, 4], [7, 7]] and valid.all()
    assert drafter.free(state, end, history[:, 4]).tolist() == [True, False]


def drafter_and_draft(method, config, params):
    """Each drafter that can give way to lookup, on a chain of 3, with an untrained draft."""
    plan, chain = SkipPlan.parse("1", config.num_layers), TreeSpec.chain(3)
    if method == "s3d":
        return S3DDrafter(config, plan, chain, 3), init_draft(params, config, plan)
    if method == "self-spec":  # a threshold of 0: it drafts whenever lookup does not
        return SelfSpecDrafter(config, plan, chain, AdaptiveThreshold(initial=0.0)), {}
    return KangarooDrafter(config, chain, exit_layer=1, eta=0.0), init_adapter(params, config, 1)


@pytest.mark.parametrize("method", ["s3d", "self-spec", "kangaroo"])
@pytest.mark.parametrize("config, seed", [(LLAMA, 0), (PHI3, 1)], ids=["llama", "phi3"])
def test_greedy_drafters_giving_way_to_lookup_are_ar(config, seed, method):
    params, prompt, ar, expected = repeating_case(config, seed)
    drafter, draft = drafter_and_draft(method, config, params)
    for switch in (1, 2):
        assert Runner(SpecDecoder.create(ar, WithLookup(drafter, switch)), (params, draft)).generate(prompt, 48).tokens \
            == expected


def test_a_self_spec_step_that_lookup_drafted_leaves_the_threshold():
    # The step's chain is lookup's ("4 5" occurred before), so the drafter drafted nothing: the acceptance rate and
    # threshold stay where the last step Self-Spec drafted left them.
    params = random_params(LLAMA, 0)
    drafter, _ = drafter_and_draft("self-spec", LLAMA, params)
    history = jnp.asarray([[4, 5, 6, 4, 5, 0, 0, 0]], jnp.int32)
    inner = {**drafter.threshold.init(), "drafted": jnp.asarray([3], jnp.int32)}
    step = WithLookup(drafter, switch=2)
    end, cache = jnp.asarray([4], jnp.int32), kv.init_cache(LLAMA, 1, 16)
    state = (inner, history.at[:, 4:].set(0), jnp.int32(0), jnp.int32(2))
    assert step.free(state, end, history[:, 4]).tolist() == [True]  # what the gate weighs the step by
    nodes, valid, _, _, (inner, _, looked_up, _) = step.draft(params, {}, cache, end, history[:, 4], state, None,
                                                              Sampling())
    assert nodes[0].tolist() == [6, 4, 5] and inner["drafted"].tolist() == [0] and int(looked_up) == 1
    # Forced to the model (the gate's measurement), the same step is Self-Spec's own, and no longer free.
    forced = step.force(state, False)
    assert step.free(forced, end, history[:, 4]).tolist() == [False]
    assert int(step.draft(params, {}, cache, end, history[:, 4], forced, None, Sampling())[4][2]) == 0
    after = drafter.update(inner, end, jnp.asarray([3]), None, None)
    assert float(after["threshold"]) == float(inner["threshold"]) and int(after["stages"]) == 0


def test_smollm2_s3d_with_lookup_equals_ar_in_fewer_steps(smollm2):
    from s3djax.tokenizer import encode_prompt

    text = "Write a Python function that returns the nth Fibonacci number, with a docstring and tests."
    ids = encode_prompt(smollm2.tokenizer, text, chat_template=True)
    ar = methods.build("ar", smollm2, max_cache_len=128)  # 128 as in the other SmolLM2 tests: XLA's cache shares it
    expected = Runner(ar.decoder, ar.params).generate(ids, 64).tokens
    # The untrained draft, so that the margin is lookup's whatever the shipped draft has learnt (the one trained on
    # 10,000 answers already drafts this prompt in as few steps as lookup does).
    alone, switched = (methods.build("s3d", smollm2, max_cache_len=128, lookup=k, draft_path="none") for k in (0, 2))
    assert not isinstance(alone.decoder.drafter, WithLookup)
    assert isinstance(switched.decoder.drafter, WithLookup) and "lookup where 2+ tokens match" in switched.draft
    alone, switched = (Runner(b.decoder, b.params).generate(ids, 64) for b in (alone, switched))
    assert alone.tokens == switched.tokens == expected
    # 53 steps alone, 48 with lookup (jax 0.10.2, CPU): code repeats names and punctuation that lookup can copy
    assert switched.stats["verify_steps"] < alone.stats["verify_steps"]
