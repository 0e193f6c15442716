"""Self-Spec (Draft & Verify): sub-layer skipping drafts, the adaptive draft-exit threshold, lossless output."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s3djax import cache as kv
from s3djax import methods, model
from s3djax.decode import ARDecoder, Runner
from s3djax.skip_plan import DynamicPlan, SkipPlan
from s3djax.speculative import draft_vocab
from s3djax.speculative.drafters.self_spec import AdaptiveThreshold, SelfSpecDrafter, load_plan, save_plan
from s3djax.speculative.loop import SpecDecoder
from s3djax.speculative.tree import TreeSpec
from tiny import LLAMA, PHI3, random_params

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


@pytest.mark.parametrize("config", [LLAMA, PHI3], ids=["llama", "phi3"])
@pytest.mark.parametrize("spec", ["1.attn,2.mlp", "0.mlp,1-2,3.attn"])
def test_a_traced_plan_gives_the_static_plans_logits(config, spec):
    params, plan = random_params(config, 1), SkipPlan.parse(spec, config.num_layers)
    tokens = jnp.asarray([PROMPT], jnp.int32)
    t = tokens.shape[1]
    slots = jnp.zeros((1,), jnp.int32)

    def run(params, plan):
        cache = kv.init_cache(config, 1, 16)
        static, dynamic = (plan, None) if isinstance(plan, SkipPlan) else (None, plan)
        decoder, variables = model.Decoder(config, static), {"params": params}
        hidden, cache = decoder.apply(variables, tokens, jnp.arange(t)[None], cache, slots, kv.causal_mask(slots, t, 16),
                                      dynamic=dynamic)
        return decoder.apply(variables, hidden, method="logits"), cache

    static = jax.jit(lambda p: run(p, plan))(params)
    traced = jax.jit(run)(params, DynamicPlan.of(plan))
    for a, b in zip(jax.tree.leaves(static), jax.tree.leaves(traced)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_threshold_follows_the_papers_rule():
    rule = AdaptiveThreshold(initial=0.6, target=0.8, step=0.01, beta1=0.5, beta2=0.9)
    state = rule.init()
    # (accepted, drafted) per verify stage, then the rate and threshold worked out by hand:
    # 1: rate = 1/4 (beta1 is 0 at the first stage) <= 0.8 -> 0.9*0.6 + 0.1*0.61 = 0.601
    # 2: rate = 0.5*0.25 + 0.5*1.0 = 0.625 <= 0.8 -> 0.9*0.601 + 0.1*0.611 = 0.602
    # 3: nothing drafted: unchanged
    # 4: rate = 0.5*0.625 + 0.5*1.0 = 0.8125 > 0.8 -> 0.9*0.602 + 0.1*0.592 = 0.601
    expected = [(0.25, 0.601), (0.625, 0.602), (0.625, 0.602), (0.8125, 0.601)]
    for (accepted, drafted), (rate, threshold) in zip([(1, 4), (3, 3), (0, 0), (2, 2)], expected):
        state = rule.update(state, jnp.int32(accepted), jnp.int32(drafted))
        assert float(state["rate"]) == pytest.approx(rate) and float(state["threshold"]) == pytest.approx(threshold)
    assert int(state["stages"]) == 3


def random_plan(config, rng) -> SkipPlan:
    """Each sub-layer skipped with probability 1/2, keeping at least one."""
    while True:
        attn, mlp = rng.random(config.num_layers) < 0.5, rng.random(config.num_layers) < 0.5
        if attn.any() or mlp.any():
            return SkipPlan(tuple(map(bool, attn)), tuple(map(bool, mlp)))


@pytest.mark.parametrize("config, seed, tree, vocab", [(LLAMA, 0, TreeSpec.chain(5), False),
                                                       (PHI3, 1, TreeSpec.spine(4, 2), False),
                                                       (LLAMA, 2, TreeSpec.spine(3, 2), True)],
                         ids=["llama-chain", "phi3-top2", "llama-top2-vocab"])
def test_greedy_self_spec_is_ar_token_for_token(config, seed, tree, vocab):
    rng = np.random.default_rng(seed)
    params, plan = random_params(config, seed), random_plan(config, rng)
    prompt = rng.integers(0, config.vocab_size, rng.integers(3, 12)).tolist()
    ar = ARDecoder(config, 96, eos_ids=())
    expected = Runner(ar, params).generate(prompt, 40).tokens
    # A low starting threshold drafts deep, so rejections happen at every depth.
    decoder = SpecDecoder.create(ar, SelfSpecDrafter(config, plan, tree, AdaptiveThreshold(0.05)))
    # A draft vocabulary of the even tokens: the odd ones are never drafted, only emitted by verification.
    draft = draft_vocab.attach({}, {"vocab": list(range(0, config.vocab_size, 2))} if vocab else {}, params)
    result = Runner(decoder, (params, draft)).generate(prompt, 40)
    assert result.tokens == expected, plan.spec()
    assert result.stats["mean_drafted"] > 0 and result.stats["verify_steps"] < 40


@pytest.mark.parametrize("drafted", [0, 3, 5])
def test_verification_scores_the_whole_chain_however_deep_drafting_went(drafted):
    # One forward over every node, drafted or not (a conditional narrowing it copies the cache both ways);
    # the undrafted nodes are invalid, so what is accepted, emitted and committed is the drafted chain's.
    from s3djax.sampling import Sampling
    from s3djax.speculative import verify

    ran = []

    class Recording(SelfSpecDrafter):
        def score(self, params, cache, length, last, nodes, state, tree):
            jax.debug.callback(lambda: ran.append(tree.num_nodes))
            return super().score(params, cache, length, last, nodes, state, tree)

    config, tree = LLAMA, TreeSpec.chain(5)
    params = random_params(config, 0)
    drafter = Recording(config, SkipPlan.parse("1", config.num_layers), tree)
    length, last = jnp.asarray([4], jnp.int32), jnp.asarray([3], jnp.int32)
    nodes = jnp.asarray([[7, 8, 9, 10, 11]], jnp.int32)
    valid = jnp.arange(5)[None] < drafted
    cache, accepted, emitted, _, _ = jax.block_until_ready(jax.jit(
        lambda c, v: drafter.verify(params, {}, c, length, last, nodes, v, None, {}, None, Sampling()))(
        kv.init_cache(config, 1, 16), valid))
    assert ran == [6]
    # What it accepts, emits and commits is the whole chain's verification.
    full_cache, full_accepted, full_emitted, _ = verify.verify(params, kv.init_cache(config, 1, 16), length, last,
                                                               nodes, valid, config=config, tree=tree.arrays(1))
    a = int(accepted[0])
    assert a == int(full_accepted[0]) and emitted[0, :a + 1].tolist() == full_emitted[0, :a + 1].tolist()
    end = 4 + a + 1
    for ours, full in zip(cache, full_cache):
        np.testing.assert_allclose(ours["k"][:, :end], full["k"][:, :end], rtol=1e-4, atol=1e-5)


def test_a_plan_file_round_trips_and_bad_ones_are_refused(tmp_path):
    from s3djax.errors import UserError

    plan = SkipPlan.parse("3.attn,5-7.mlp,9", 12)
    save_plan(str(tmp_path / "p.yaml"), plan, {"objective_ms_per_token": 1.5})
    assert load_plan(str(tmp_path / "p.yaml"), 12) == (plan, {"skip": plan.spec(), "num_layers": 12,
                                                           "objective_ms_per_token": 1.5})
    with pytest.raises(UserError, match="12 layers"):
        load_plan(str(tmp_path / "p.yaml"), 30)
    (tmp_path / "bad.yaml").write_text("- not a mapping\n")
    with pytest.raises(UserError, match="not a skip plan"):
        load_plan(str(tmp_path / "bad.yaml"), 12)
    with pytest.raises(UserError, match="no such"):
        load_plan(str(tmp_path / "missing.yaml"), 12)
    save_plan(str(tmp_path / "deep.yaml"), plan, {"max_draft": 4})
    assert load_plan(str(tmp_path / "deep.yaml"), 12)[1]["max_draft"] == 4
    save_plan(str(tmp_path / "zero.yaml"), plan, {"max_draft": 0})
    with pytest.raises(UserError, match="max_draft must be a whole number of at least 1, got 0"):
        load_plan(str(tmp_path / "zero.yaml"), 12)


def test_the_shipped_plan_brings_its_measured_max_draft(smollm2):
    from s3djax import methods

    built = methods.build("self-spec", smollm2, max_cache_len=128)
    # benchmarks/results/archive/lookup-drafters-cpu-2026-11-26/ measured it fastest, giving way to lookup (the CPU's default).
    assert built.decoder.drafter.tree.depth == 2
    assert "max draft 2 (the draft file's max draft" in built.draft and "tree chain, vocabulary 8192" in built.draft
    assert built.draft.endswith("lookup where 1+ tokens match")
    assert built.params[1]["head"].shape == (8192, smollm2.config.hidden_size)
    assert methods.build("self-spec", smollm2, max_cache_len=128, max_draft=3).decoder.drafter.tree.depth == 3
    assert methods.build("self-spec", smollm2, max_cache_len=128, skip="13").decoder.drafter.tree.depth == 12


def test_smollm2_self_spec_equals_ar(smollm2):
    from s3djax.tokenizer import encode_prompt

    ids = encode_prompt(smollm2.tokenizer, "List three uses of a paperclip.", chat_template=True)
    ar = methods.build("ar", smollm2, max_cache_len=128)
    expected = Runner(ar.decoder, ar.params).generate(ids, 24).tokens
    built = methods.build("self-spec", smollm2, max_cache_len=128, skip="10-19.mlp,12-17.attn", max_draft=6,
                          tree="top2")
    result = Runner(built.decoder, built.params).generate(ids, 24)
    assert result.tokens == expected and result.stats["mean_drafted"] > 0


def test_a_plan_file_takes_a_draft_vocabulary(smollm2, tmp_path):
    import json

    from s3djax.errors import UserError
    from train.draft_vocab import main as draft_vocab_main

    rows = np.random.default_rng(0).integers(3, 500, (4, 16)).astype(np.int32)  # answers only from ids 3..499
    for split in ("train", "eval"):
        np.savez(tmp_path / f"{split}-00000.npz", tokens=rows, loss_mask=np.ones_like(rows, np.uint8),
                 lengths=np.full(4, 16, np.int32))
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "s3djax-token-shards/1", "vocab_size": 49152, "splits": {
        s: {"shards": [f"{s}-00000.npz"], "rows": 4} for s in ("train", "eval")}}))
    plan = SkipPlan.parse("10-19.mlp,12-17.attn", 30)
    save_plan(str(tmp_path / "plan.yaml"), plan, {"max_draft": 2})
    draft_vocab_main(["--data", str(tmp_path), "--size", "600", "--sharegpt", "20", "--draft", str(tmp_path / "plan.yaml"),
                      "--out", str(tmp_path / "vocab.yaml")])
    loaded, record = load_plan(str(tmp_path / "vocab.yaml"), 30)
    assert loaded == plan and record["max_draft"] == 2 and record["vocab_coverage"] == 1.0
    assert len(record["vocab"]) == 600 and set(np.unique(rows).tolist()) <= set(record["vocab"])
    built = methods.build("self-spec", smollm2, max_cache_len=128, draft_path=str(tmp_path / "vocab.yaml"))
    assert built.draft.endswith("tree chain, vocabulary 600, draft weights int8, lookup where 1+ tokens match")
    assert "max draft 2 (" in built.draft
    assert built.params[1]["head"].shape == (600, 576)
    save_plan(str(tmp_path / "bad.yaml"), plan, {"vocab": [5, 49152]})
    with pytest.raises(UserError, match="token ids in 0..49151"):
        methods.build("self-spec", smollm2, max_cache_len=128, draft_path=str(tmp_path / "bad.yaml"))
