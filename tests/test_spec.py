"""The speculative loop is lossless: greedy s3d output equals greedy ar output, token for token."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpu_kernels import matmul as cm
from s3djax import cache as kv
from s3djax.config import ModelConfig
from s3djax.decode import ARDecoder, Runner
from s3djax.model import Decoder, layer_key, with_layers
from s3djax.skip_plan import SkipPlan
from s3djax.speculative import tree as trees
from s3djax.speculative import verify as verify_module
from s3djax.cache import init_cache
from s3djax.sampling import Sampling
from s3djax.speculative.draft_params import init_draft, load_draft, save_draft
from s3djax.speculative.drafters.base import Drafter
from s3djax.speculative.drafters.lookup import WithLookup
from s3djax.speculative.drafters.s3d import S3DDrafter, default_gamma, default_plan
from s3djax.speculative.drafters.s3d_in_verify import InVerifyS3DDrafter
from s3djax.speculative.loop import SpecDecoder
from s3djax.speculative.tree import TreeSpec
from tiny import LLAMA, PHI3, random_correction, random_params

CACHE = 96


def perturbed_draft(params, config, plan, seed):
    """A draft that is wrong in a random way: a noisy mask token and random (non-zero) LoRA adapters."""
    draft = init_draft(params, config, plan, lora_rank=2, key=jax.random.key(seed))
    keys = iter(jax.random.split(jax.random.key(seed + 1), 1000))
    draft = jax.tree.map(lambda a: a + 0.5 * jax.random.normal(next(keys), a.shape), draft)
    return draft


def ar_runner(config, params, eos=(), cache=CACHE):
    return Runner(ARDecoder(config, cache, eos_ids=eos), params)


def spec_runner(config, params, draft, plan, tree, gamma, eos=(), cache=CACHE):
    decoder = SpecDecoder.create(ARDecoder(config, cache, eos_ids=eos), S3DDrafter(config, plan, tree, gamma))
    return Runner(decoder, (params, draft))


def test_lossless_with_a_draft_vocabulary():
    # A draft over a third of the vocabulary: some of the target's tokens can never be drafted.
    params, plan = random_params(LLAMA, 0), SkipPlan.parse("1", LLAMA.num_layers)
    ids = jnp.arange(0, LLAMA.vocab_size, 3, dtype=jnp.int32)
    draft = {**perturbed_draft(params, LLAMA, plan, 5), "vocab": ids, "head": params["lm_head"][ids]}
    ar = ar_runner(LLAMA, params)
    for tree_name in ("chain", "tree-8"):
        spec = spec_runner(LLAMA, params, draft, plan, trees.resolve(tree_name, 4), 4)
        for prompt in ([5], list(range(40, 55))):
            assert spec.generate(prompt, 40).tokens == ar.generate(prompt, 40).tokens


def corrected(draft, config, seed):
    return {**draft, "correction": random_correction(config, seed)}


@pytest.mark.parametrize("vocab", [False, True], ids=["full-vocab", "draft-vocab"])
def test_lossless_with_a_previous_token_correction(vocab):
    params, plan = random_params(LLAMA, 0), SkipPlan.parse("1", LLAMA.num_layers)
    draft = corrected(perturbed_draft(params, LLAMA, plan, 5), LLAMA, 9)
    if vocab:  # 49 of 97 tokens: still more than the correction's 32 candidates
        ids = jnp.arange(0, LLAMA.vocab_size, 2, dtype=jnp.int32)
        draft = {**draft, "vocab": ids, "head": params["lm_head"][ids]}
    ar = ar_runner(LLAMA, params)
    for tree_name, gamma in (("chain", 4), ("tree-8", 4), ("tree-16", 4), ("chain", 1)):
        spec = spec_runner(LLAMA, params, draft, plan, trees.resolve(tree_name, gamma), gamma)
        for prompt in ([5], list(range(40, 55))):
            assert spec.generate(prompt, 40).tokens == ar.generate(prompt, 40).tokens, (tree_name, prompt)


def test_a_corrected_node_drafts_given_its_own_token():
    # Chain and tree agree on rank-0 paths; a sibling's children differ from the spine's because the
    # correction sees a different parent token (the uncorrected draft gives every node at a depth the same).
    params, plan = random_params(LLAMA, 1), SkipPlan.parse("1", LLAMA.num_layers)
    draft = corrected(perturbed_draft(params, LLAMA, plan, 2), LLAMA, 4)
    tree = trees.TreeSpec.from_paths([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)])
    drafter = S3DDrafter(LLAMA, plan, tree, 3)
    cache = init_cache(LLAMA, 2, 32)
    length, last = jnp.array([0, 0]), jnp.array([5, 17])
    nodes = drafter.draft(params, draft, cache, length, last, (), None, Sampling())[0]
    chain = S3DDrafter(LLAMA, plan, trees.resolve("chain", 3), 3).draft(params, draft, cache, length, last, (), None,
                                                                        Sampling())[0]
    np.testing.assert_array_equal(nodes[:, [0, 2, 4]], chain)
    assert (nodes[:, 2] != nodes[:, 3]).any()
    plain = drafter.draft(params, {k: v for k, v in draft.items() if k != "correction"}, cache, length, last, (), None,
                          Sampling())[0]
    np.testing.assert_array_equal(plain[:, 2], plain[:, 3])


@pytest.mark.parametrize("cache", [300, 1000])
def test_lossless_past_several_key_blocks(cache):
    # Caches over 128 slots take the occupied-prefix attention loop; the prompt and output cross blocks.
    params, plan = random_params(PHI3, 2), SkipPlan.parse("1-2", PHI3.num_layers)
    draft = perturbed_draft(params, PHI3, plan, 7)
    prompt = list(range(3, 80)) * 2
    spec = spec_runner(PHI3, params, draft, plan, trees.resolve("tree-8", 4), 4, cache=cache)
    assert spec.generate(prompt, 60).tokens == ar_runner(PHI3, params, cache=cache).generate(prompt, 60).tokens


COMBOS = [  # (tree name, gamma, skip spec): every named tree, dynamic trees, gamma 1/2/3/4/6, several plans
    ("chain", 1, "1-2"), ("chain", 2, "1"), ("chain", 4, "1-2"), ("chain", 6, "2.attn,1.mlp"),
    ("tree-8", 4, "1-2"), ("tree-16", 4, ""), ("tree-32", 6, "1"), ("tree-64", 4, "1-2"),
    ("dynamic-8", 4, "1-2"), ("dynamic-16", 3, "1"),
]


@pytest.mark.parametrize("tree_name, gamma, skip", COMBOS)
def test_lossless_on_llama_for_every_tree_gamma_and_plan(tree_name, gamma, skip):
    params = random_params(LLAMA, 0)
    plan = SkipPlan.parse(skip, LLAMA.num_layers)
    tree = trees.resolve(tree_name, gamma)
    drafts = {"untrained": init_draft(params, LLAMA, plan), "perturbed": perturbed_draft(params, LLAMA, plan, 3)}
    ar = ar_runner(LLAMA, params)
    total_accepted = 0
    for draft_name, draft in drafts.items():
        spec = spec_runner(LLAMA, params, draft, plan, tree, gamma)
        for prompt in ([5], [3, 1, 4, 1, 5, 9, 2, 6], list(range(40, 55))):
            expected = ar.generate(prompt, 40).tokens
            got = spec.generate(prompt, 40)
            assert got.tokens == expected, (draft_name, prompt)
            # Each step emits its accepted drafts plus the bonus; the last step may overshoot the budget.
            assert sum(a + 1 for a in got.stats["accepted_per_step"]) >= len(got.tokens) - 1
            total_accepted += got.stats["mean_accepted_tokens"] > 1
    assert total_accepted > 0  # some drafts were accepted, so the accept/commit path was exercised


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(config=st.sampled_from([LLAMA, PHI3]), seed=st.integers(0, 2**16),
       prompt=st.lists(st.integers(0, 88), min_size=1, max_size=16), max_new=st.integers(1, 30))
def test_lossless_for_random_models_and_prompts(config, seed, prompt, max_new):
    # Weights and prompts vary, shapes do not: all examples share two compiled decoders per architecture.
    params = random_params(config, seed)
    plan = SkipPlan.parse("1-2", config.num_layers)
    draft = perturbed_draft(params, config, plan, seed) if seed % 2 else init_draft(params, config, plan)
    expected = ar_runner_cached(config)(params).generate(prompt, max_new).tokens
    assert spec_runner_cached(config)(params, draft).generate(prompt, max_new).tokens == expected


_runners = {}


def ar_runner_cached(config):
    def make(params):
        runner = _runners.setdefault(("ar", config), ar_runner(config, params))
        runner.params = params
        return runner
    return make


def spec_runner_cached(config):
    plan = SkipPlan.parse("1-2", config.num_layers)

    def make(params, draft):
        key = ("s3d", config, "lora" in draft)
        runner = _runners.setdefault(key, spec_runner(config, params, draft, plan, trees.resolve("tree-8", 4), 4))
        runner.params = (params, draft)
        return runner
    return make


@dataclasses.dataclass(frozen=True)
class OracleDrafter(Drafter):
    """Proposes the true continuation (from `draft["reference"]`, indexed by position) along a chain."""

    config: ModelConfig
    tree: TreeSpec
    gamma: int

    def draft(self, params, draft, cache, length, last, state, key, sampling):
        positions = length[:, None] + jnp.asarray(self.tree.node_depths[1:])[None]
        return draft["reference"][positions], jnp.ones(positions.shape, bool), None, cache, state


def oracle_runner(config, params, reference, gamma, eos=(), cache=CACHE):
    decoder = SpecDecoder.create(ARDecoder(config, cache, eos_ids=eos), OracleDrafter(config, TreeSpec.chain(gamma), gamma))
    padded = jnp.zeros(cache + gamma + 2, jnp.int32).at[:len(reference)].set(jnp.asarray(reference))
    return Runner(decoder, (params, {"reference": padded}))


@pytest.mark.parametrize("config, skip", [(LLAMA, "1"), (PHI3, "2.attn,1.mlp")], ids=["llama", "phi3-sub-layers"])
def test_the_verify_pass_drafts_what_a_block_after_each_anchor_would(config, skip):
    # The chain's logits are plain tree verification's; each anchor's branch is a draft block, [anchor token, masks]
    # run alone through the draft's plan and adapters, after the chain before the anchor went through the target.
    params, plan, k = random_params(config, 0), SkipPlan.parse(skip, config.num_layers), 3
    draft = perturbed_draft(params, config, plan, 3)
    drafter = InVerifyS3DDrafter(config, plan, TreeSpec.chain(k), k)
    prompt = jnp.asarray([list(range(10, 22)), list(range(30, 42))], jnp.int32)
    state = SpecDecoder.create(ARDecoder(config, 48, eos_ids=()), drafter).ar.start(params, prompt, jnp.asarray([12, 9]),
                                                                        jax.random.key(0))
    cache, length, last = state["cache"], state["length"], state["last"]
    nodes = jax.random.randint(jax.random.key(1), (2, k), 0, config.vocab_size)
    logits, branches, _ = drafter.forward(params, draft, cache, length, last, nodes)
    want, _ = verify_module.score(params, cache, length, last, nodes, config=config, tree=drafter.tree.arrays(2))
    np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)
    tokens, positions = jnp.concatenate([last[:, None], nodes], 1), length[:, None] + jnp.arange(k + 1)
    _, chained = Decoder(config).apply({"params": params}, tokens, positions, cache, length, kv.causal(length, k + 1))
    masks = jnp.broadcast_to(draft["mask_embed"], (2, k, config.hidden_size))
    for anchor in range(k + 1):
        start, token = length + anchor, Decoder(config).apply({"params": params}, tokens[:, anchor:anchor + 1],
                                                              method="embed_tokens")
        alone, _ = Decoder(config, plan).apply({"params": params}, None, start[:, None] + jnp.arange(k + 1), chained,
                                               start, kv.causal(start, k + 1),
                                               embeds=jnp.concatenate([token, masks], 1), lora=draft["lora"])
        np.testing.assert_allclose(branches[:, anchor], alone[:, 1:], rtol=1e-4, atol=1e-5)
    assert np.abs(np.asarray(branches[:, 0] - branches[:, 1])).max() > 1e-3  # the anchors' branches differ


@pytest.mark.parametrize("config, gamma, skip", [(LLAMA, 1, "1-2"), (LLAMA, 3, "1"), (PHI3, 4, "2.attn,1.mlp")])
def test_drafting_inside_the_verify_pass_is_lossless(config, gamma, skip):
    params, plan = random_params(config, 0), SkipPlan.parse(skip, config.num_layers)
    drafter = InVerifyS3DDrafter(config, plan, TreeSpec.chain(gamma), gamma)
    cases = [([5], CACHE), ([3, 1, 4, 1, 5, 9, 2, 6], CACHE), (list(range(1, 12)), 40)]  # the last meets the cache end
    perturbed = perturbed_draft(params, config, plan, 3)
    runs = [(init_draft(params, config, plan), drafter),  # no adapters at all
            (perturbed, WithLookup(drafter, switch=1, ngram=2)), (corrected(perturbed, config, 9), drafter)]
    accepted = 0
    for draft, wrapped in runs:
        for prompt, cache in cases:
            spec = Runner(SpecDecoder.create(ARDecoder(config, cache, eos_ids=()), wrapped), (params, draft))
            got = spec.generate(prompt, 60)
            assert got.tokens == ar_runner(config, params, cache=cache).generate(prompt, 60).tokens, prompt
            accepted += sum(got.stats["accepted_per_step"])
    assert accepted > 0


def test_eos_inside_an_accepted_path_ends_the_output_there():
    params, prompt = random_params(LLAMA, 0), [3, 1, 4, 1, 5, 9, 2, 6]
    free = ar_runner(LLAMA, params).generate(prompt, 30).tokens
    eos = next(t for t in free[5:] if t not in free[:5])  # a token whose first use is mid-stream
    expected = ar_runner(LLAMA, params, eos=(eos,)).generate(prompt, 30).tokens
    assert expected[-1] == eos and len(expected) < 30
    got = oracle_runner(LLAMA, params, prompt + free, gamma=4, eos=(eos,)).generate(prompt, 30)
    assert got.tokens == expected
    steps = got.stats["accepted_per_step"]
    assert steps == [4] * len(steps)  # an oracle draft is always accepted whole, so the EOS fell inside a chain
    assert got.stats["mean_accepted_tokens"] == 5.0 and got.stats["acceptance_by_depth"] == [1.0] * 4


def test_output_matches_ar_at_the_cache_length_boundary():
    # 11 prompt tokens + whole chains of 5 reach slot 36, where a 5-node tree runs into the slack slots.
    params, prompt, cache = random_params(LLAMA, 0), list(range(1, 12)), 40
    expected = ar_runner(LLAMA, params, cache=cache).generate(prompt, 100).tokens
    assert len(expected) == cache - len(prompt)  # the cache, not the budget, ended it
    got = oracle_runner(LLAMA, params, prompt + expected, gamma=4, cache=cache).generate(prompt, 100)
    assert got.tokens == expected
    plan = SkipPlan.parse("1-2", LLAMA.num_layers)
    s3d = spec_runner(LLAMA, params, init_draft(params, LLAMA, plan), plan, trees.resolve("tree-16", 4), 4, cache=cache)
    assert s3d.generate(prompt, 100).tokens == expected


def batch_case(params, cache=CACHE):
    """Rows of different lengths for a batch: with the EOS returned, one ends there, one at the cache's end, one
    repeats itself (prompt lookup matches it, the others less), the others go on."""
    prompts = [[5], [3, 1, 4, 1, 5, 9, 2, 6], list(range(10, 20)) * 3, [(7 * i) % 90 + 1 for i in range(cache - 20)]]
    free = [ar_runner(LLAMA, params).generate(p, 30).tokens for p in prompts]
    eos = next(t for i, t in enumerate(free[1]) if i >= 3 and t not in free[1][:i] + free[2] + free[3])
    return prompts, (eos,)


@pytest.mark.parametrize("tree_name, switch", [("chain", 0), ("tree-8", 0), ("chain", 2)],
                         ids=["chain", "tree-8", "chain-lookup"])
def test_a_batch_drafts_each_row_on_its_own_cursor_as_it_decodes_alone(tree_name, switch):
    # A target whose skipped layer barely moves the residual stream: the draft's first token is often right.
    params, plan = random_params(LLAMA, 0), SkipPlan.parse("1", LLAMA.num_layers)
    layer = params[layer_key(1)]
    params = with_layers(params, {1: {"attn": {"o": 0.05 * layer["attn"]["o"]}, "mlp": {"down": 0.05 * layer["mlp"]["down"]}}})
    prompts, eos = batch_case(params)
    drafter = S3DDrafter(LLAMA, plan, trees.resolve(tree_name, 4), 4)
    decoder = SpecDecoder.create(ARDecoder(LLAMA, CACHE, eos_ids=eos),
                                 WithLookup(drafter, switch=switch) if switch else drafter)
    runner = Runner(decoder, (params, init_draft(params, LLAMA, plan)))
    alone = [runner.generate(p, 30) for p in prompts]
    assert alone[1].tokens[-1] == eos[0] and len(alone[1].tokens) < 30 and len(alone[3].tokens) == 20
    assert [a.tokens for a in alone] == [ar_runner(LLAMA, params, eos=eos).generate(p, 30).tokens for p in prompts]
    batch = runner.generate_batch(prompts, 30)
    assert [r.tokens for r in batch] == [a.tokens for a in alone]
    # Each row drafted and accepted what it does alone: the batch's forward computes every row as alone.
    assert [r.stats["accepted_per_step"] for r in batch] == [a.stats["accepted_per_step"] for a in alone]
    assert sum(sum(a.stats["accepted_per_step"]) for a in alone) > 5


def test_compiles_once_across_prompt_lengths_and_iterations(compiles):
    params = random_params(LLAMA, 0)
    plan = SkipPlan.parse("1-2", LLAMA.num_layers)
    runner = spec_runner(LLAMA, params, init_draft(params, LLAMA, plan), plan, trees.resolve("tree-8", 4), 4)
    runner.generate([1, 2, 3], 5)
    warm = compiles()
    for prompt, n in (([4] * 11, 60), ([7, 8], 20), (list(range(16)), 33)):
        result = runner.generate(prompt, n, on_tokens=lambda t: None, chunk=7)
        assert result.stats["verify_steps"] > 3
    assert compiles() == warm


def test_draft_file_round_trip(tmp_path):
    params = random_params(LLAMA, 0)
    plan = SkipPlan.parse("1-2", LLAMA.num_layers)
    draft = perturbed_draft(params, LLAMA, plan, 5)
    save_draft(str(tmp_path / "d.npz"), draft, {"skip": plan.spec(), "gamma": 4})
    loaded, meta = load_draft(str(tmp_path / "d.npz"), LLAMA, jnp.float32)
    assert meta == {"mask_token": "extra-row", "skip": "1-2", "gamma": 4}
    assert jax.tree.structure(loaded) == jax.tree.structure(draft)
    jax.tree.map(lambda a, b: (a == b).all() or pytest.fail("leaf changed"), loaded, draft)


def test_smollm2_s3d_equals_ar(smollm2):
    from s3djax import methods
    from s3djax.tokenizer import encode_prompt

    ar = methods.build("ar", smollm2, max_cache_len=128)  # 128 as in the other SmolLM2 tests: XLA's cache shares it
    ar = Runner(ar.decoder, ar.params)
    cases = [("chain", "What is the capital of France? Answer in one paragraph."),
             ("tree-16", "Write a haiku about the sea.")]
    for tree, text in cases:
        s3d = methods.build("s3d", smollm2, max_cache_len=128, tree=tree, draft_path="none")
        assert s3d.warnings and "untrained" in s3d.warnings[0]
        # Unset, gamma is a named tree's depth, else the data file's (the suite fixes defaults).
        gamma = s3d.decoder.drafter.gamma
        fastest = default_gamma(None)
        assert gamma == {"chain": fastest, "tree-16": 4}[tree] and f"gamma {gamma}" in s3d.draft
        ids = encode_prompt(smollm2.tokenizer, text, chat_template=True)
        expected = ar.generate(ids, 40).tokens
        got = Runner(s3d.decoder, s3d.params).generate(ids, 40)
        assert got.tokens == expected, (tree, text)
        # Every token after the first came from a verify step emitting at most gamma + 1.
        assert got.stats["verify_steps"] * (gamma + 1) >= len(got.tokens) - 1 > 4


def test_an_int8_draft_reads_int8_copies_of_its_layers_and_stays_lossless():
    from s3djax import quant
    from s3djax.speculative import draft_weights

    params, plan = random_params(LLAMA, 0), SkipPlan.parse("1", LLAMA.num_layers)
    ids = jnp.arange(0, LLAMA.vocab_size, 3, dtype=jnp.int32)
    plain = perturbed_draft(params, LLAMA, plan, 5)
    draft = {**plain, "vocab": ids, "head": params["lm_head"][ids]}
    draft8 = draft_weights.attach(draft, params, "int8", jnp.float32, plan=plan)
    kept = [i for i in range(LLAMA.num_layers) if i != 1]
    assert sorted(map(int, draft8["weights"])) == kept and quant.is_int8(draft8["head"])
    assert draft_weights.attach(draft, params, "none", jnp.float32, plan=plan) is draft
    # Named where the draft has int8 weights of its own; an int8 target's copies are its own arrays.
    params8 = quant.apply(params, "int8", jnp.float32)
    assert draft_weights.about(draft8, params) == ", draft weights int8"
    assert draft_weights.about(draft_weights.attach(plain, params8, "int8", jnp.float32, plan=plan), params8) == ""

    ar = ARDecoder(LLAMA, CACHE, eos_ids=())
    state = ar.start(params, jnp.asarray([list(range(40, 55))]), jnp.asarray([15]), jax.random.key(0))
    drafter = S3DDrafter(LLAMA, plan, TreeSpec.chain(3), 3)
    logits = lambda p, d: drafter.block_logits(p, d, state["cache"], state["length"], state["last"])[0]
    # The draft reads exactly the int8 copies: the same logits as a float draft over their dequantized values.
    rounded = draft_weights.of(params, quant.dequantize_tree(draft8))
    got = logits(params, draft8)
    np.testing.assert_allclose(got, logits(rounded, {**draft, "head": quant.dequantize(draft8["head"])}),
                               rtol=1e-5, atol=1e-5)
    assert not np.allclose(got, logits(params, draft), rtol=1e-5, atol=1e-5)
    for prompt in ([5], list(range(40, 55))):
        spec = spec_runner(LLAMA, params, draft8, plan, TreeSpec.chain(3), 3)
        assert spec.generate(prompt, 40).tokens == ar_runner(LLAMA, params).generate(prompt, 40).tokens


def test_an_int8_draft_folds_its_adapters_into_its_copies_and_stays_lossless():
    from s3djax import quant
    from s3djax.speculative import draft_weights

    params, plan = random_params(LLAMA, 0), SkipPlan.parse("1", LLAMA.num_layers)
    draft = perturbed_draft(params, LLAMA, plan, 5)
    folded = draft_weights.attach(draft, params, "int8", jnp.float32, plan=plan, fold=True)
    assert "lora" not in folded and "lora" in draft_weights.attach(draft, params, "int8", jnp.float32, plan=plan)
    # An int8 target's copies are its own arrays: nothing to fold into, so the adapters stay.
    assert "lora" in draft_weights.attach(draft, quant.apply(params, "int8", jnp.float32), "int8", jnp.float32,
                                          plan=plan, fold=True)
    ar = ARDecoder(LLAMA, CACHE, eos_ids=())
    state = ar.start(params, jnp.asarray([list(range(40, 55))]), jnp.asarray([15]), jax.random.key(0))
    drafter = S3DDrafter(LLAMA, plan, TreeSpec.chain(3), 3)
    logits = lambda p, d: drafter.block_logits(p, d, state["cache"], state["length"], state["last"])[0]
    # The draft reads int8 of W + A B and no adapter: the logits of a float draft over those weights dequantized...
    got = logits(params, folded)
    rounded = draft_weights.of(params, quant.dequantize_tree(folded))
    np.testing.assert_allclose(got, logits(rounded, folded), rtol=1e-5, atol=1e-5)
    layer = draft_weights.folded({"layers_0": {"attn": {"q": params["layers_0"]["attn"]["q"]}}}, draft["lora"])
    a, b = draft["lora"][0]["q"]["a"], draft["lora"][0]["q"]["b"]
    np.testing.assert_allclose(layer["layers_0"]["attn"]["q"], params["layers_0"]["attn"]["q"] + a @ b, rtol=1e-6,
                               atol=1e-6)
    # ...which draft as the float adapters do, as near as int8 copies with their adapters apart, far nearer than none.
    apart, apart8 = logits(params, draft), logits(params, draft_weights.attach(draft, params, "int8", jnp.float32,
                                                                               plan=plan))
    bare = logits(params, {k: v for k, v in draft.items() if k != "lora"})
    assert np.abs(got - apart).max() < 1.5 * np.abs(apart8 - apart).max() < 0.1 * np.abs(bare - apart).max()
    for prompt in ([5], list(range(40, 55))):
        spec = spec_runner(LLAMA, params, folded, plan, TreeSpec.chain(3), 3)
        assert spec.generate(prompt, 40).tokens == ar_runner(LLAMA, params).generate(prompt, 40).tokens


def test_the_cpu_drafts_with_int8_weights_and_verifies_with_the_float_target(smollm2):
    from s3djax import methods, quant

    int8 = lambda tree: [quant.is_int8(w) for w in jax.tree.leaves(tree, is_leaf=quant.is_weight) if quant.is_weight(w)]
    # Linears a sub-layer holds: on the CPU kernel q/k/v and gate/up are joined (quant.pack_for_cpu), else apart.
    attn, mlp = (2, 2) if cm.usable() else (4, 3)
    for method in ("s3d", "self-spec", "kangaroo", "s2d"):
        built = methods.build(method, smollm2, max_cache_len=128)
        target, draft = built.params
        assert "draft weights int8" in built.draft and quant.mode_of(target) == "none" and all(int8(draft["head"]))
        if method == "kangaroo":  # its layers are the target's own; its adapter is its own
            assert "weights" not in draft and int8(draft["attn"]) == [True] * attn
        elif method == "s2d":  # its base layers, under its own adapters
            assert sorted(map(int, draft["weights"])) == list(range(8)) and int8(draft["weights"]) == [True] * 8 * (attn + mlp)
        else:
            plan = built.decoder.drafter.plan
            # Only the sub-layers the plan runs, each with its linears.
            runs = {i: ("attn",) * plan.attn[i] + ("mlp",) * plan.mlp[i] for i in range(30)}
            assert {int(i): tuple(layer) for i, layer in draft["weights"].items()} == {i: r for i, r in runs.items() if r}
            assert int8(draft["weights"]) == [True] * sum(attn * plan.attn[i] + mlp * plan.mlp[i] for i in range(30))
        none = methods.build(method, smollm2, max_cache_len=128, draft_weights="none")
        assert not any(int8(none.params[1])) and "draft weights" not in none.draft


def test_profiling_mode_times_each_step_apart():
    from s3djax.speculative.profile import step_times

    params = random_params(LLAMA, 0)
    plan = SkipPlan.parse("1-2", LLAMA.num_layers)
    runner = spec_runner(LLAMA, params, init_draft(params, LLAMA, plan), plan, trees.resolve("tree-8", 4), 4)
    times = step_times(runner.decoder, runner.params, runner.prefill([1, 2, 3, 4]), repeats=2,
                       trees={"chain": TreeSpec.chain(4), "tree-8": trees.resolve("tree-8", 4)})
    assert set(times) == {"ar_step_ms", "draft_step_ms", "verify_chain_ms", "verify_tree-8_ms"}
    assert all(v > 0 for v in times.values())
    assert runner.generate([1, 2, 3, 4], 10).tokens == ar_runner(LLAMA, params).generate([1, 2, 3, 4], 10).tokens


def test_a_draft_file_brings_its_plan_and_silences_the_warning(smollm2, tmp_path):
    from s3djax import methods

    plan = SkipPlan.parse("10-19", smollm2.config.num_layers)
    draft = init_draft(smollm2.params, smollm2.config, plan, lora_rank=2)
    draft["mask_embed"] = draft["mask_embed"] + 1.0
    save_draft(str(tmp_path / "d.npz"), draft, {"skip": plan.spec(), "gamma": 4})
    built = methods.build("s3d", smollm2, max_cache_len=64, draft_path=str(tmp_path / "d.npz"))
    assert built.warnings == [] and built.decoder.drafter.plan == plan
    assert (built.params[1]["mask_embed"] == draft["mask_embed"]).all()
    overridden = methods.build("s3d", smollm2, max_cache_len=64, draft_path=str(tmp_path / "d.npz"), skip="8-21")
    assert overridden.decoder.drafter.plan == default_plan(30)


def test_a_corrected_draft_file_drafts_dynamic_trees_without_its_correction(smollm2, tmp_path):
    from s3djax import methods

    draft = corrected(init_draft(smollm2.params, smollm2.config, default_plan(30)), smollm2.config, 1)
    save_draft(str(tmp_path / "c.npz"), draft, {"correction_rank": 4})
    built = methods.build("s3d", smollm2, max_cache_len=64, draft_path=str(tmp_path / "c.npz"), tree="tree-8")
    assert "previous-token correction rank 4" in built.draft and built.warnings == []
    dynamic = methods.build("s3d", smollm2, max_cache_len=64, draft_path=str(tmp_path / "c.npz"), tree="dynamic-8")
    assert "correction" not in dynamic.params[1] and "correction" not in dynamic.draft
    assert dynamic.warnings == ["dynamic-8 drafts without the draft's previous-token correction, which needs a "
                                "static tree"]


@pytest.mark.parametrize("config", [LLAMA, PHI3], ids=["llama", "phi3"])
def test_a_draft_keeping_every_layer_is_always_right_at_depth_1(config):
    # Block position 0 is the last token through the full model over the committed cache: exactly the
    # target's next-token prediction. Anything below 1.0 means a RoPE, K/V or off-by-one bug.
    params = random_params(config, 7)
    plan = SkipPlan.full(config.num_layers)
    draft = init_draft(params, config, plan, lora_rank=2)  # zero adapters are no-ops
    got = spec_runner(config, params, draft, plan, TreeSpec.chain(3), 3).generate([2, 7, 1, 8, 2, 8], 40)
    assert got.stats["acceptance_by_depth"][0] == 1.0 and got.stats["verify_steps"] > 5


def test_a_full_mode_draft_replaces_the_verifying_layers(smollm2, tmp_path):
    from s3djax import methods, quant

    plan = default_plan(30)
    tuned = smollm2.params["layers_0"]["attn"]["q"] * 1.01
    # The flat layer layout of files written before the Flax modules: nested on load.
    draft = {**init_draft(smollm2.params, smollm2.config, plan), "layers": {"0": {"q": tuned}}}
    save_draft(str(tmp_path / "full.npz"), draft, {"skip": plan.spec(), "gamma": 4, "mode": "full"})
    built = methods.build("s3d", smollm2, max_cache_len=64, draft_path=str(tmp_path / "full.npz"))
    params, loaded = built.params
    assert "trained in full mode" in built.warnings[0] and "layers" not in loaded
    target = quant.pack_for_cpu(smollm2.params)  # the target's arrays, or their one packed copy (CPU kernel)

    def same(a, b):
        return [id(x) for x in jax.tree.leaves(a)] == [id(x) for x in jax.tree.leaves(b)]

    def columns(layer, lo, hi):  # columns [lo, hi) of q/k/v, joined on the CPU kernel (quant.pack_for_cpu) or apart
        attn = layer["attn"]
        parts = [attn["qkv"]] if "qkv" in attn else [attn[n] for n in ("q", "k", "v")]
        return jnp.concatenate([quant.dequantize(w) for w in parts], axis=1)[:, lo:hi]

    q, k = tuned.shape[1], smollm2.params["layers_0"]["attn"]["k"].shape[1]
    assert (columns(params["layers_0"], 0, q) == tuned).all()
    assert same(params["layers_1"], target["layers_1"])
    assert (columns(params["layers_0"], q, q + k) == columns(target["layers_0"], q, q + k)).all()


def test_the_shipped_draft_is_the_default_and_beats_the_untrained_one(smollm2):
    from s3djax import methods, registry
    from s3djax.bench_data import mt_bench
    from s3djax.speculative.loop import acceptance
    from s3djax.tokenizer import encode_prompt

    path = registry.lookup("smollm2-135m").draft_path()
    # The mask tokens need depth > 1; lookup, off, would draft some steps for either draft.
    shipped = methods.build("s3d", smollm2, max_cache_len=128, gamma=4, lookup=0)
    assert shipped.warnings == [] and os.path.relpath(path) in shipped.draft
    plan = shipped.decoder.drafter.plan.spec()
    untrained = methods.build("s3d", smollm2, max_cache_len=128, draft_path="none", gamma=4, lookup=0, skip=plan)
    assert untrained.decoder.drafter == shipped.decoder.drafter
    # The untrained draft over the shipped one's vocabulary, so that the margin measures the training
    # alone, not the vocabulary's trade of a little acceptance for speed.
    vocab = {k: shipped.params[1][k] for k in ("vocab", "head")}
    ar = methods.build("ar", smollm2, max_cache_len=128)
    runs = {"shipped": Runner(shipped.decoder, shipped.params), "ar": Runner(ar.decoder, ar.params),
            "untrained": Runner(untrained.decoder, (untrained.params[0], {**untrained.params[1], **vocab}))}
    accepted = {"shipped": [], "untrained": []}
    for q in mt_bench()[:2]:
        ids = encode_prompt(smollm2.tokenizer, q["turns"][0], chat_template=True)
        expected = runs["ar"].generate(ids, 40).tokens
        for name in accepted:
            got = runs[name].generate(ids, 40)
            assert got.tokens == expected
            accepted[name] += got.stats["accepted_per_step"]
    # Depth 2, the first mask token: at depth 1 the draft is the last token through the kept layers, which with
    # 28 of 30 kept agrees with the verifier nearly as often untrained.
    alpha = {name: acceptance(a, 4)["acceptance_by_depth"][1] for name, a in accepted.items()}
    # Measured: 0.37 against 0.12 on the first two prompts (the 28-layer draft of 2026-11-28).
    assert alpha["shipped"] > alpha["untrained"] + 0.2, alpha
