"""Speculative sampling is lossless: the emitted tokens follow exactly the target's sampling distribution.

A 12-token vocabulary makes the target's exact distribution over the next tokens computable by
brute force, so tens of thousands of sampled continuations (one vmapped, jitted call) can be
compared with it by a chi-square test, which must also reject a deliberately broken acceptance rule.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from s3djax import model
from s3djax.config import ModelConfig
from s3djax.decode import ARDecoder, Runner, row_axes, stack_rows
from s3djax import sampling as sampling_module
from s3djax.sampling import Sampling
from s3djax.sampling import process_logits_reference as process_logits
from s3djax.skip_plan import SkipPlan
from s3djax.speculative import draft_vocab
from s3djax.speculative import tree as trees
from s3djax.speculative import verify as verify_module
from s3djax.speculative.draft_params import init_draft
from s3djax.speculative.drafters.kangaroo import KangarooDrafter, init_adapter
from s3djax.speculative.drafters.lookup import LookupDrafter, WithLookup
from s3djax.speculative.drafters.s3d import S3DDrafter
from s3djax.speculative.drafters.s3d_in_verify import InVerifyS3DDrafter
from s3djax.speculative.drafters.self_spec import AdaptiveThreshold, SelfSpecDrafter
from s3djax.speculative.loop import SpecDecoder
from tests.tiny import LLAMA, random_correction, random_params

SMALL = ModelConfig(arch="llama", vocab_size=12, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4,
                    num_kv_heads=2, head_dim=8, rope_theta=100.0)
PROMPT = [1, 5, 3, 7]
SAMPLES = 16_000
SIGNIFICANCE = 1e-3  # a correct sampler fails one run in a thousand


@pytest.fixture(autouse=True)
def few_candidates(monkeypatch):
    """Top-p searches its cut among 4 candidates of the 12 tokens, so a sampled step takes the candidates' path at
    some rows and the full sort at others; the exact distribution is the full sort's (`process_logits_reference`)."""
    monkeypatch.setattr(sampling_module, "CANDIDATES", 4)


@functools.cache
def scaled_params():
    # Scaled so that next-token distributions are neither flat nor one-hot.
    return jax.tree.map(lambda a: a * 4 if a.ndim == 2 else a, model.init_params(SMALL, jax.random.key(11)))


@pytest.fixture(scope="module")
def params():
    return scaled_params()


@functools.partial(jax.jit, static_argnames="sampling")  # op by op, a forward compiled ~100 small programs
def next_token_probs(params, rows, sampling: Sampling):
    """The processed next-token distributions [B, 3, V] after each of the rows' last three positions."""
    hidden, _ = model.forward_sequence(params, rows, config=SMALL)
    logits = model.Decoder(SMALL).apply({"params": params}, hidden[:, -3:], method="logits")
    return jax.nn.softmax(process_logits(logits, sampling), -1)


@functools.cache
def exact_joint(sampling: Sampling) -> np.ndarray:
    """P(t1, t2, t3 | PROMPT) [V, V, V] under the processed target distribution, by brute force: one causal
    forward over every PROMPT + [t1, t2] gives all three factors. Cached: several tests share a sampling."""
    v = SMALL.vocab_size
    grid = np.stack(np.meshgrid(np.arange(v), np.arange(v), indexing="ij"), -1).reshape(-1, 2)
    rows = np.concatenate([np.tile(PROMPT, (len(grid), 1)), grid], 1)
    probs = np.asarray(next_token_probs(scaled_params(), jnp.asarray(rows, jnp.int32), sampling), np.float64)
    p1, p2, p3 = probs[0, 0], probs[::v, 1], probs[:, 2].reshape(v, v, v)
    return p1[:, None, None] * p2[:, :, None] * p3


def sampled_joint(params, decoder, draft, **overrides) -> np.ndarray:
    """Counts [V, V, V] of the first three new tokens over SAMPLES seeds, in one vmapped call; `overrides` set
    entries of the start state (the pause gate's)."""
    prompt, lengths = jnp.asarray([PROMPT], jnp.int32), jnp.asarray([len(PROMPT)], jnp.int32)
    both = params if draft is None else (params, draft)

    def three(key):
        state = {**decoder.start(both, prompt, lengths, key), **{k: jnp.asarray(v) for k, v in overrides.items()}}
        state = decoder.decode(both, state, jnp.int32(3))
        return state["tokens"][0, :3]
    return joint_counts(three)


def joint_counts(three) -> np.ndarray:
    """Counts [V, V, V] of `three(key)`'s three tokens over SAMPLES keys, in one vmapped call."""
    tokens = np.asarray(jax.jit(jax.vmap(three))(jax.random.split(jax.random.key(0), SAMPLES)))
    v = SMALL.vocab_size
    return np.bincount((tokens[:, 0] * v + tokens[:, 1]) * v + tokens[:, 2], minlength=v ** 3).reshape(v, v, v)


def chi_square_p(counts, probs) -> float:
    """Goodness of fit, pooling cells expected fewer than 5 times into one."""
    probs = probs.ravel() / probs.sum()  # fp32 softmaxes sum to 1 within rounding only
    counts, expected = counts.ravel(), probs * counts.sum()
    if counts[expected == 0].any():  # a token the target cannot emit (cut by top-k / top-p)
        return 0.0
    small, big = (expected > 0) & (expected < 5), expected >= 5
    observed, expected = np.append(counts[big], counts[small].sum()), np.append(expected[big], expected[small].sum())
    keep = expected > 0  # the pooled cell is empty when nothing is small
    return stats.chisquare(observed[keep], expected[keep]).pvalue


def spec_decoder(sampling, tree, gamma=4, skip="1-2"):
    plan = SkipPlan.parse(skip, SMALL.num_layers)
    return SpecDecoder.create(ARDecoder(SMALL, 32, eos_ids=(), sampling=sampling),
                              S3DDrafter(SMALL, plan, trees.resolve(tree, gamma), gamma)), plan


T1 = Sampling(temperature=1.0)
SHAPED = Sampling(temperature=0.7, top_k=6, top_p=0.9)
NUCLEUS = Sampling(temperature=0.5, top_p=0.6)  # nuclei of 3 to 5 tokens: inside the 4 candidates or not


@pytest.mark.parametrize("sampling", [T1, SHAPED, NUCLEUS], ids=["t1", "shaped", "nucleus"])
def test_the_target_itself_passes(params, sampling):
    # The test of the harness, and of AR's own sampler: plain AR sampling against the brute-force distribution.
    decoder = ARDecoder(SMALL, 32, eos_ids=(), sampling=sampling)
    exact = exact_joint(sampling)
    assert exact.max() < 0.5 and (exact > 1e-3).sum() > 40  # spread enough to say something
    assert chi_square_p(sampled_joint(params, decoder, None), exact) > SIGNIFICANCE


def test_top_p_takes_both_paths_here(params):
    rows = jnp.asarray([PROMPT + [t] for t in range(SMALL.vocab_size)], jnp.int32)
    kept = (np.asarray(next_token_probs(params, rows, NUCLEUS)) > 0).sum(-1)  # each nucleus's size
    assert (kept <= sampling_module.CANDIDATES).any() and (kept > sampling_module.CANDIDATES).any(), kept


# SHAPED on tree-8 is sampled as a row of a batch (`test_a_row_of_a_batch_samples_the_target_distribution`).
@pytest.mark.parametrize("sampling, tree", [(T1, "chain"), (T1, "tree-16"), (SHAPED, "dynamic-8"),
                                            (NUCLEUS, "chain"), (NUCLEUS, "tree-8")],
                         ids=["t1-chain", "t1-tree16", "shaped-dynamic8", "nucleus-chain", "nucleus-tree8"])
def test_s3d_samples_the_target_distribution(params, sampling, tree):
    decoder, plan = spec_decoder(sampling, tree)
    counts = sampled_joint(params, decoder, init_draft(params, SMALL, plan))
    assert chi_square_p(counts, exact_joint(sampling)) > SIGNIFICANCE


def test_a_row_of_a_batch_samples_the_target_distribution(params):
    # The prompt's row beside another at its own cursor (a longer prompt, its own draws, a later stop): a batch's
    # step drafts and verifies both rows, and each commits what it accepted.
    decoder, plan = spec_decoder(SHAPED, "tree-8")
    both, other = (params, init_draft(params, SMALL, plan)), [2, 9, 4, 4, 8, 1, 6]
    axes = row_axes(decoder, both)

    def three(key):
        rows = [decoder.start(both, jnp.asarray([p], jnp.int32), jnp.asarray([len(p)], jnp.int32), k)
                for p, k in zip((other, PROMPT), jax.random.split(key))]
        return decoder.decode(both, stack_rows(rows, axes), jnp.asarray([6, 3], jnp.int32))["tokens"][1, :3]
    assert chi_square_p(joint_counts(three), exact_joint(SHAPED)) > SIGNIFICANCE


def test_a_draft_vocabulary_samples_the_target_distribution(params):
    # The draft proposes only from half the vocabulary: tokens outside it come from the residual.
    decoder, plan = spec_decoder(T1, "tree-8")
    ids = jnp.arange(0, SMALL.vocab_size, 2, dtype=jnp.int32)
    draft = {**init_draft(params, SMALL, plan), "vocab": ids, "head": params["embed"][ids]}
    assert chi_square_p(sampled_joint(params, decoder, draft), exact_joint(T1)) > SIGNIFICANCE


@pytest.mark.parametrize("sampling, tree, candidates", [(T1, "tree-16", 32), (SHAPED, "tree-8", 5)],
                         ids=["t1-tree16", "shaped-tree8-5-candidates"])
def test_a_previous_token_correction_samples_the_target_distribution(params, monkeypatch, sampling, tree, candidates):
    # Each node's children come from its own corrected q; with 5 candidates, q is 0 on 7 of 12 tokens.
    from s3djax.speculative.drafters import s3d

    monkeypatch.setattr(s3d, "CANDIDATES", candidates)
    decoder, plan = spec_decoder(sampling, tree)
    draft = {**init_draft(params, SMALL, plan), "correction": random_correction(SMALL, 3)}
    assert chi_square_p(sampled_joint(params, decoder, draft), exact_joint(sampling)) > SIGNIFICANCE


def test_autoregressive_drafting_samples_the_target_distribution(params):
    # Self-Spec's chain drafter with variable draft lengths (a low adaptive threshold) and a top-2 spine.
    plan = SkipPlan.parse("1-2", SMALL.num_layers)
    drafter = SelfSpecDrafter(SMALL, plan, trees.TreeSpec.spine(3, 2), AdaptiveThreshold(initial=0.2))
    decoder = SpecDecoder.create(ARDecoder(SMALL, 32, eos_ids=(), sampling=T1), drafter)
    assert chi_square_p(sampled_joint(params, decoder, {}), exact_joint(T1)) > SIGNIFICANCE


def test_s2d_nested_drafting_samples_the_target_distribution(params):
    # S2D's chain from its early exits, under top-k and top-p together.
    from s3djax.speculative.drafters.s2d import S2DDrafter
    from s3djax.speculative.drafters.s2d_artifact import init_lora

    keys = iter(jax.random.split(jax.random.key(3), 100))
    lora = init_lora(params, SMALL, 3, 2, jax.random.key(2))
    draft = {"lora": jax.tree.map(lambda a: a + 0.3 * jax.random.normal(next(keys), a.shape), lora),
             "thresholds": jnp.asarray([0.3, 0.3, 0.3])}
    decoder = SpecDecoder.create(ARDecoder(SMALL, 32, eos_ids=(), sampling=SHAPED),
                                 S2DDrafter(SMALL, trees.TreeSpec.chain(3), (1, 2, 3)))
    assert chi_square_p(sampled_joint(params, decoder, draft), exact_joint(SHAPED)) > SIGNIFICANCE


def test_a_kangaroo_draft_vocabulary_samples_the_target_distribution(params):
    # Chain drafting over half the vocabulary: the draft's q is zero outside it.
    adapter = draft_vocab.attach(init_adapter(params, SMALL, 1), {"vocab": list(range(0, SMALL.vocab_size, 2))}, params)
    drafter = KangarooDrafter(SMALL, trees.TreeSpec.spine(3, 2), exit_layer=1, eta=0.0)
    decoder = SpecDecoder.create(ARDecoder(SMALL, 32, eos_ids=(), sampling=T1), drafter)
    assert chi_square_p(sampled_joint(params, decoder, adapter), exact_joint(T1)) > SIGNIFICANCE


def test_prompt_lookup_samples_the_target_distribution(params):
    # Point-mass drafts: tokens of the prompt and of the draws so far, accepted with the target's probability.
    decoder = SpecDecoder.create(ARDecoder(SMALL, 32, eos_ids=(), sampling=SHAPED),
                                 LookupDrafter(SMALL, trees.TreeSpec.chain(2), ngram=2))
    assert chi_square_p(sampled_joint(params, decoder, {}), exact_joint(SHAPED)) > SIGNIFICANCE


def test_s3d_giving_way_to_lookup_samples_the_target_distribution(params):
    # Steps switch between S3D's q and lookup's point masses by the history alone (one matching token suffices).
    decoder, _ = spec_decoder(SHAPED, "chain", gamma=2)
    decoder = SpecDecoder.create(decoder.ar, WithLookup(decoder.drafter, switch=1, ngram=2))
    plan = decoder.drafter.inner.plan
    assert chi_square_p(sampled_joint(params, decoder, init_draft(params, SMALL, plan)),
                        exact_joint(SHAPED)) > SIGNIFICANCE


def test_drafting_inside_the_verify_pass_samples_the_target_distribution(params):
    # A chain of 1: after a first step that accepts nothing, the second verifies what the first's branch drew, its
    # q rescored given the bonus token. The adapters are made non-zero, so the branch rows differ from the chain's
    # by more than the mask token.
    plan = SkipPlan.parse("1-2", SMALL.num_layers)
    drafter = InVerifyS3DDrafter(SMALL, plan, trees.TreeSpec.chain(1), 1)
    decoder = SpecDecoder.create(ARDecoder(SMALL, 32, eos_ids=(), sampling=SHAPED), drafter)
    draft = init_draft(params, SMALL, plan, lora_rank=2)
    keys = iter(jax.random.split(jax.random.key(5), 100))
    draft["lora"] = jax.tree.map(lambda a: a + 0.3 * jax.random.normal(next(keys), a.shape), draft["lora"])
    draft["correction"] = random_correction(SMALL, 3)
    assert chi_square_p(sampled_joint(params, decoder, draft), exact_joint(SHAPED)) > SIGNIFICANCE


@pytest.mark.parametrize("kind", ["none", "giving-way", "alone", "kangaroo"],
                         ids=["s3d", "s3d-giving-way-to-lookup", "lookup", "kangaroo"])
def test_pausing_by_the_running_acceptance_samples_the_target_distribution(params, kind):
    # The first step drafts; whether the next ones do depends on what earlier steps accepted (an expected acceptance
    # of 0.6, half the rate with no mean yet, against a breakeven of 0.5: one rejected step pauses the next), and
    # lookup's on whether its proposal was the token a paused step drew (its hint). Giving way, the steps lookup drafts
    # weigh the same expectation against a breakeven of their own.
    decoder, plan = spec_decoder(NUCLEUS, "chain", gamma=2)
    drafter = {"none": decoder.drafter, "giving-way": WithLookup(decoder.drafter, switch=1, ngram=2),
               "alone": LookupDrafter(SMALL, trees.TreeSpec.chain(2), ngram=2),
               "kangaroo": KangarooDrafter(SMALL, trees.TreeSpec.chain(2), exit_layer=1, eta=0.0)}[kind]
    decoder = SpecDecoder.create(decoder.ar, drafter, gate=True)
    draft = init_adapter(params, SMALL, 1) if kind == "kangaroo" else init_draft(params, SMALL, plan)
    counts = sampled_joint(params, decoder, draft, rate=np.float32(1.2),
                           total=np.float32(0.0), breakeven=np.float32(0.5), breakeven_free=np.float32(0.55))
    assert chi_square_p(counts, exact_joint(NUCLEUS)) > SIGNIFICANCE


def test_a_broken_acceptance_rule_is_caught(params, monkeypatch):
    # Accepting every draft outright makes the output follow the draft, not the target.
    monkeypatch.setattr(verify_module, "accept_probability", lambda r, q: jnp.ones_like(r))
    decoder, plan = spec_decoder(T1, "tree-8")
    counts = sampled_joint(params, decoder, init_draft(params, SMALL, plan))
    assert chi_square_p(counts, exact_joint(T1)) < 1e-6


def test_a_near_zero_temperature_is_greedy_and_seeds_reproduce():
    params, prompt = random_params(LLAMA, 2), [3, 1, 4, 1, 5]
    plan = SkipPlan.parse("1-2", LLAMA.num_layers)
    draft = init_draft(params, LLAMA, plan, lora_rank=2)

    runners = {}  # one compile per sampling setting

    def run(sampling, seed):
        if sampling not in runners:
            decoder = SpecDecoder.create(ARDecoder(LLAMA, 64, eos_ids=(), sampling=sampling),
                                         S3DDrafter(LLAMA, plan, trees.resolve("tree-8", 4), 4))
            runners[sampling] = Runner(decoder, (params, draft))
        return runners[sampling].generate(prompt, 24, seed=seed).tokens

    greedy = Runner(ARDecoder(LLAMA, 64, eos_ids=()), params).generate(prompt, 24).tokens
    assert run(Sampling(temperature=1e-4), 0) == greedy
    warm = Sampling(temperature=1.0)
    assert run(warm, 3) == run(warm, 3) and run(warm, 3) != run(warm, 4)


def test_a_tree_with_a_missing_rank_cannot_be_sampled():
    from s3djax.errors import UserError

    tree = trees.TreeSpec.from_paths([(0,), (2,)])
    with pytest.raises(UserError, match="cannot be sampled"):
        SpecDecoder.create(ARDecoder(SMALL, 32, eos_ids=(), sampling=T1), S3DDrafter(SMALL, SkipPlan.parse("1", 4), tree, 1))
