"""Prompt lookup: the n-gram match on known histories, and greedy output equal to `ar` on random and real models."""

import jax.numpy as jnp
import numpy as np
import pytest

from s3djax import methods
from s3djax.decode import ARDecoder, Runner
from s3djax.speculative.drafters.lookup import LookupDrafter, propose
from s3djax.speculative.loop import SpecDecoder
from s3djax.speculative.tree import TreeSpec
from tests.tiny import LLAMA, PHI3, random_params


def proposed(history, end, ngram=3, depth=4):
    tokens, valid = propose(jnp.asarray([history], jnp.int32), jnp.asarray([end], jnp.int32), ngram, depth)
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
    tokens, valid = propose(history, jnp.asarray([2, 5], jnp.int32), 2, 3)
    assert tokens[0].tolist()[:1] == [2] and valid[0].tolist() == [True, True, False]
    assert valid[1].tolist() == [True, False, False] and int(tokens[1, 0]) == 3


@pytest.mark.parametrize("config, seed, depth, ngram", [(LLAMA, 0, 4, 3), (PHI3, 1, 6, 2), (LLAMA, 2, 1, 1)],
                         ids=["llama-d4", "phi3-d6", "llama-d1"])
def test_greedy_lookup_is_ar_token_for_token(config, seed, depth, ngram):
    rng = np.random.default_rng(seed)
    params = random_params(config, seed)
    # A prompt that repeats itself, so the draft finds matches from the first step.
    phrase = rng.integers(0, config.vocab_size, 6).tolist()
    prompt = phrase * 3 + phrase[:2]
    ar = ARDecoder(config, 96, eos_ids=())
    expected = Runner(ar, params).generate(prompt, 48).tokens
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
    assert built.decoder.drafter.tree.depth == methods.LOOKUP_DEPTH and built.decoder.drafter.ngram == 3
    result = Runner(built.decoder, built.params).generate(ids, 48)
    assert result.tokens == expected
    assert result.stats["mean_accepted_tokens"] > 1.5
