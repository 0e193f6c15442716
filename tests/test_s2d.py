"""S2D: greedy output equals each target's ar token for token, alone and giving way to prompt lookup, with int8
copies of the draft's layers too, early exits, lookup's steps and paused steps keep the draft cache exact, SoFT's
gradients reach every exit, and a tiny training run writes an artifact `--method s2d` loads."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s3djax import cache as kv
from s3djax import model, quant
from s3djax.decode import ARDecoder
from s3djax.errors import UserError
from s3djax.skip_plan import SkipPlan
from s3djax.speculative import draft_vocab, draft_weights
from s3djax.speculative import tree as trees
from s3djax.speculative.drafters.s2d import S2DDrafter, first_exit
from s3djax.speculative.drafters.lookup import WithLookup
from s3djax.speculative.drafters.s2d_artifact import init_lora, parse_exits, parse_thresholds
from s3djax.speculative.loop import SpecDecoder
from tiny import LLAMA, PHI3, random_params

CACHE, BUCKET, EXITS = 96, 16, (1, 2, 3)
PROMPTS = ([5], [3, 1, 4, 1, 5, 9, 2, 6], list(range(40, 52)))


@functools.cache
def compiled(decoder):
    return jax.jit(decoder.start), jax.jit(decoder.decode)


def generate(decoder, params, prompt, n, **overrides):
    """(the first n new tokens, the final loop state): one executable per decoder, prompts padded alike; `overrides`
    set start-state entries (the pause gate's breakeven)."""
    start, decode = compiled(decoder)
    padded = jnp.asarray([prompt + [0] * (BUCKET - len(prompt))], jnp.int32)
    state = start(params, padded, jnp.asarray([len(prompt)], jnp.int32), jax.random.key(0))
    state = decode(params, {**state, **{k: jnp.float32(v) for k, v in overrides.items()}}, jnp.int32(n))
    return np.asarray(state["tokens"])[0, :n].tolist(), state


def s2d_decoder(config, tree, lookup=0):
    """S2D on its own, or giving way to prompt lookup where `lookup`+ tokens match."""
    drafter = S2DDrafter(config, trees.resolve(tree, 4), EXITS)
    return SpecDecoder.create(ARDecoder(config, CACHE, eos_ids=()), WithLookup(drafter, lookup) if lookup else drafter)


def own_steps(state, tree_depth=4):
    """Steps S2D drafted itself, giving way to lookup: each counts its root and every chain token but the deepest at
    their exits."""
    return int(np.asarray(state["drafter"][0]["exit_counts"]).sum()) // tree_depth


def noisy_lora(params, config, seed, scale):
    lora = init_lora(params, config, EXITS[-1], 2, jax.random.key(seed))
    keys = iter(jax.random.split(jax.random.key(seed + 1), 1000))
    return jax.tree.map(lambda a: a + scale * jax.random.normal(next(keys), a.shape), lora)


@functools.cache
def base(config):
    """A random model and random adapters on its first layers (made once: eager random ops are slow)."""
    params = random_params(config, 0)
    return params, noisy_lora(params, config, 1, 0.05)


def case(config, target: str):
    """(target params, draft params): the draft's base is the original model; the target is that model,
    its int8 version, or a model whose layers were changed (the multi-target setting). The float and
    changed cases both pass the base layers explicitly, so they share one executable."""
    original, lora = base(config)
    draft = {"lora": lora, "thresholds": jnp.asarray(THRESHOLDS[config.arch])}
    if target == "int8":
        return quant.apply(original, "int8", jnp.float32), draft  # the draft runs on the int8 layers too
    draft["layers"] = model.layers_of(original)[:EXITS[-1]]
    if target in ("int8-draft", "int8-folded"):  # int8 copies of the base layers (the adapters folded in); float target
        n = config.num_layers
        return original, draft_weights.attach(draft, original, "int8", jnp.float32, fold=target == "int8-folded",
                                              plan=SkipPlan.skipping_layers(n, range(EXITS[-1], n)))
    if target == "vocab":  # a draft vocabulary of the even tokens: the odd ones are never drafted
        return original, draft_vocab.attach(draft, {"vocab": list(range(0, config.vocab_size, 2))}, original)
    if target == "other-layers":
        keys = iter(jax.random.split(jax.random.key(9), 1000))
        tuned = jax.tree.map(lambda a: a * (1 + 0.1 * jax.random.normal(next(keys), a.shape)),
                             dict(enumerate(model.layers_of(original))))
        return model.with_layers(original, tuned), draft
    return original, draft


# Random tiny models are unconfident (top-1 around 0.05-0.3): these split the drafted tokens over all exits.
THRESHOLDS = {"llama": [0.12, 0.1], "phi3": [0.12, 0.1]}


def test_first_exit_is_the_first_passing_exit_and_the_last_one_always_stops():
    conf = jnp.asarray([[0.9, 0.9, 0.1], [0.1, 0.7, 0.1], [0.1, 0.1, 0.0], [0.8, 0.2, 0.9], [0.5, 0.6, 0.0]])
    assert first_exit(conf, jnp.asarray([0.8, 0.6])).tolist() == [0, 1, 2, 0, 1]  # reaching a threshold passes
    assert first_exit(conf, jnp.asarray([1.01, 1.01])).tolist() == [2] * 5        # exits switched off
    assert first_exit(conf[:, :1], jnp.zeros(0)).tolist() == [0] * 5               # one exit: it always stops
    assert parse_thresholds("0.8,0.6,0", 3) == (0.8, 0.6) == parse_thresholds("0.8,0.6", 3)
    assert parse_exits("4,6,8", 30) == (4, 6, 8)
    for bad in ("0.8", "0.8,x", "0.8,-1"):
        with pytest.raises(UserError):
            parse_thresholds(bad, 3)
    for bad in ("6,4,8", "0,2", "4,30", ""):
        with pytest.raises(UserError):
            parse_exits(bad, 30)


def test_the_nested_forward_stops_where_first_exit_says():
    from s3djax.speculative.drafters.s2d import confidence

    params, draft = case(LLAMA, "float")
    drafter = S2DDrafter(LLAMA, trees.TreeSpec.chain(4), EXITS)
    tokens, t = jnp.asarray([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3]]), 16
    positions, zero = jnp.arange(t)[None], jnp.zeros(1, jnp.int32)
    mask = kv.causal_mask(zero, t, t)
    cache = kv.init_cache(LLAMA.replace(num_layers=3), 1, t)

    @jax.jit
    def run():
        # Every exit's logits at every position, the long way, and the full-depth cache of the sequence.
        x, logits = drafter.embed(params, tokens), []
        for j in range(3):
            x, _ = drafter._segment(params, draft, j, x, positions, cache[j:j + 1], zero, mask)
            logits.append(drafter.exit_logits(params, {}, x)[0])
        prefix = drafter.full_depth(params, draft, tokens, positions, cache, zero, mask)[1]

        def one(i):  # token i alone, as a drafted block over the full-depth cache of tokens < i
            at = lambda a: jax.lax.dynamic_slice_in_dim(a, i, 1, axis=1)
            got, exit_, _ = drafter.nested(params, draft, at(tokens), at(positions), prefix, i[None], lambda j: at(mask))
            return got[0], exit_[0]
        return jnp.stack(logits), jax.lax.map(one, jnp.arange(t))

    logits, (got, exits) = run()                                                # [3, T, V]; [T, V], [T]
    want = first_exit(confidence(logits).T, draft["thresholds"])
    assert exits.tolist() == want.tolist() and set(want.tolist()) == {0, 1, 2}
    np.testing.assert_allclose(got, logits[want, jnp.arange(t)], atol=1e-4)


CASES = [(LLAMA, "chain", "float"), (LLAMA, "chain", "other-layers"), (PHI3, "top2", "int8"), (LLAMA, "top2", "vocab"),
         (PHI3, "chain", "int8-draft"), (LLAMA, "chain", "int8-folded")]


@pytest.mark.parametrize("config, tree, target", CASES, ids=[f"{c.arch}-{t}-{k}" for c, t, k in CASES])
def test_greedy_s2d_equals_ar_of_its_target(config, tree, target):
    params, draft = case(config, target)
    ar, spec = ARDecoder(config, CACHE, eos_ids=()), s2d_decoder(config, tree)
    exits, accepted = np.zeros(3, int), 0
    for prompt in PROMPTS:
        expected, _ = generate(ar, params, prompt, 32)
        got, state = generate(spec, (params, draft), prompt, 32)
        assert got == expected, prompt
        exits += np.asarray(state["drafter"]["exit_counts"])
        accepted += int(np.asarray(state["accepted_log"]).clip(0).sum())
    assert accepted > 0 and (exits > 0).all(), (accepted, exits)  # commits happened, every exit was used


def test_an_int8_draft_reads_int8_copies_of_its_base_layers():
    params, draft = case(LLAMA, "float")
    draft8 = case(LLAMA, "int8-draft")[1]
    assert sorted(map(int, draft8["weights"])) == list(range(EXITS[-1]))
    assert all(quant.is_int8(w) for w in jax.tree.leaves(draft8["weights"], is_leaf=quant.is_weight))
    assert all(set(layer) == {"attn_norm", "mlp_norm"} for layer in draft8["layers"])  # no float linears kept
    drafter = S2DDrafter(LLAMA, trees.TreeSpec.chain(4), EXITS)
    tokens, t = jnp.asarray([[3, 1, 4, 1, 5, 9, 2, 6]]), 8
    zero = jnp.zeros(1, jnp.int32)
    cache = kv.init_cache(LLAMA.replace(num_layers=EXITS[-1]), 1, t)
    hidden = jax.jit(lambda p, d: drafter.full_depth(p, d, tokens, jnp.arange(t)[None], cache, zero,
                                                     kv.causal_mask(zero, t, t))[0])
    got = hidden(params, draft8)
    # Exactly the int8 copies: the float draft over their dequantized values; the target's own weights differ.
    without_layers = {k: v for k, v in draft.items() if k != "layers"}
    np.testing.assert_allclose(got, hidden(draft_weights.of(params, quant.dequantize_tree(draft8)), without_layers),
                               rtol=1e-5, atol=1e-5)
    assert not np.allclose(got, hidden(params, draft), rtol=1e-5, atol=1e-5)
    # Folded, the copies are int8 of W + A B and the draft runs no adapter: the float draft over those, dequantized.
    folded = case(LLAMA, "int8-folded")[1]
    assert "lora" not in folded and "lora" not in case(PHI3, "int8-folded")[1]  # Phi-3's adapters are on its qkv too
    # A Llama's q/k/v joined (as for a GPU) under adapters on each of them: nothing folds.
    joined = {"layers_0": {"attn": {"qkv": jnp.ones((4, 12))}}}
    assert draft_weights.folded(joined, [{"q": {"a": jnp.ones((4, 1)), "b": jnp.ones((1, 4))}}]) is None
    np.testing.assert_allclose(hidden(params, folded), hidden(draft_weights.of(params, quant.dequantize_tree(folded)),
                                                              {k: v for k, v in without_layers.items() if k != "lora"}),
                               rtol=1e-5, atol=1e-5)
    assert np.abs(hidden(params, folded) - hidden(params, draft)).max() < 1.5 * np.abs(got - hidden(params, draft)).max()


@pytest.mark.parametrize("switch", [1, 2, 0], ids=["lookup-1", "lookup-2", "alone"])
def test_greedy_s2d_giving_way_to_lookup_equals_ar(switch):
    params, draft = case(LLAMA, "float")
    ar, spec = ARDecoder(LLAMA, CACHE, eos_ids=()), s2d_decoder(LLAMA, "chain", switch)
    for prompt in PROMPTS:
        expected, _ = generate(ar, params, prompt, 40)
        got, state = generate(spec, (params, draft), prompt, 40)
        assert got == expected, prompt
        if switch == 1:  # lookup drafted some steps, S2D the others
            assert 0 < own_steps(state) < int(state["iteration"]), (own_steps(state), int(state["iteration"]))


# With lookup, two of its steps in a row commit more than the next block 0 reaches back: `gave_way` keeps the cache.
@pytest.mark.parametrize("lookup", [0, 1], ids=["alone", "giving-way-to-lookup"])
def test_the_draft_cache_is_a_full_depth_prefill_at_committed_slots_and_holes_are_never_read(lookup):
    params, draft = case(LLAMA, "float")
    spec = s2d_decoder(LLAMA, "chain", lookup)
    drafter, n = spec.drafter.inner if lookup else spec.drafter, len(EXITS)
    draft_step = jax.jit(drafter.draft, static_argnums=7)
    prefill = full_depth_prefill(drafter)
    holes_then_deeper = 0
    for prompt, steps in ((PROMPTS[1], 25), (PROMPTS[2], 30)):
        _, state = generate(spec, (params, draft), prompt, steps)
        d, length = state["drafter"][0] if lookup else state["drafter"], int(state["length"][0])
        # The previous step's block 0 recomputed everything up to its root at full depth.
        last = int(state["accepted_log"][0, int(state["iteration"]) - 1])
        done = length - last - 1
        ref = prefill(params, draft, d["history"][:, :done + 1], state["cache"])
        for layer, want in zip(d["cache"], ref["cache"]):
            for name in ("k", "v"):
                np.testing.assert_allclose(layer[name][:, :done + 1], want[name][:, :done + 1], atol=2e-5)
        assert (np.asarray(d["reached"])[0, :done + 1] == n).all()

        # More draft steps with garbage in every scratch slot: an early exit's missing K/V must be masked.
        scratch = (jnp.arange(CACHE + spec.ar.slack) > length)[None, :, None, None]
        dirty = {**d, "cache": [{k: jnp.where(scratch, 1e3, v) for k, v in layer.items()} for layer in d["cache"]]}
        for root in range(0, LLAMA.vocab_size, 7):  # other roots, other chains
            args = (params, draft, state["cache"], state["length"], jnp.asarray([root], jnp.int32))
            clean = draft_step(*args, d, None, spec.ar.sampling)
            assert clean[0].tolist() == draft_step(*args, dirty, None, spec.ar.sampling)[0].tolist()
            reached = np.asarray(clean[4]["reached"])[0, length + 1:length + 4]  # chain tokens 1-3 (4 is not run)
            holes_then_deeper += any(reached[i] < n and reached[i + 1:].max() > reached[i] for i in range(2))
    assert holes_then_deeper  # some token exited early and a later one went deeper, past its hole


def full_depth_prefill(drafter):
    return jax.jit(lambda params, draft, tokens, cache: drafter.extend(
        params, draft, drafter.init_state(params, draft, cache), tokens, jnp.zeros((1,), jnp.int32), cache))


def test_paused_steps_keep_the_draft_cache_a_full_depth_prefill():
    # The pause gate with no step paying: only probes draft, after runs of 1, 2, 4, 8 paused steps, longer than block
    # 0 reaches back. Every slot the next block 0 does not recompute holds a full-depth prefill's K/V.
    params, draft = case(LLAMA, "float")
    spec = dataclasses.replace(s2d_decoder(LLAMA, "chain"), gate=True)
    ar, g = ARDecoder(LLAMA, CACHE, eos_ids=()), spec.drafter.tree.depth
    prefill = full_depth_prefill(spec.drafter)
    for prompt in PROMPTS[1:]:
        got, state = generate(spec, (params, draft), prompt, 40, breakeven=np.inf)
        assert got == generate(ar, params, prompt, 40)[0]
        assert int(state["paused"]) >= 15 and int(state["iteration"]) >= 3
        d, length = state["drafter"], int(state["length"][0])
        done = length - g - 1
        ref = prefill(params, draft, d["history"][:, :done + 1], state["cache"])
        for layer, want in zip(d["cache"], ref["cache"]):
            for name in ("k", "v"):
                np.testing.assert_allclose(layer[name][:, :done + 1], want[name][:, :done + 1], atol=2e-5)


def test_soft_gradients_reach_every_exit_and_only_layers_below_it():
    from train.s2d import soft_loss

    params, lora = base(LLAMA)  # non-zero B, so A's gradients are non-zero too
    tokens = jax.random.randint(jax.random.key(3), (2, 12), 0, LLAMA.vocab_size)
    batch = {"tokens": tokens, "loss_mask": jnp.ones((2, 12), jnp.uint8), "lengths": jnp.asarray([12, 9])}
    run = functools.partial(soft_loss, params, batch=batch, key=jax.random.key(4), config=LLAMA, exits=EXITS,
                            num_positions=6)
    # The Jacobian of the per-exit losses: leaves [exit, ...].
    per_exit, (loss, sums) = jax.jit(jax.jacrev(lambda x: (run(x)[1]["depth_loss"], run(x)), has_aux=True))(lora)
    np.testing.assert_allclose(loss, np.mean(sums["depth_loss"] / sums["depth_count"]), rtol=1e-6)
    for i, layer in enumerate(per_exit):
        moved = np.stack([np.any(np.asarray(g).reshape(len(EXITS), -1) != 0, axis=1) for g in jax.tree.leaves(layer)])
        for j, depth in enumerate(EXITS):  # exit j's loss moves every adapter below it and none above
            assert moved[:, j].all() if i < depth else not moved[:, j].any(), (j, i, moved[:, j])


def test_on_the_targets_own_greedy_answers_data_skips_the_teacher_and_scores_what_greedy_does():
    from train.s2d import soft_loss

    params, lora = base(LLAMA)
    prompt = [7, 3, 9]
    answer, _ = generate(ARDecoder(LLAMA, CACHE, eos_ids=()), params, prompt, 9)  # as train.distill writes it
    tokens = jnp.asarray([prompt + answer], jnp.int32)
    trained = (jnp.arange(12) >= 3).astype(jnp.uint8)[None]  # the prompt's tokens are not trained on
    batch = {"tokens": tokens, "loss_mask": trained, "lengths": jnp.asarray([12])}
    run = jax.jit(lambda lora, target: soft_loss(params, lora, batch, jax.random.key(4), config=LLAMA, exits=EXITS,
                                                 num_positions=6, target=target), static_argnums=1)
    (data_loss, data_sums), (greedy_loss, greedy_sums) = run(lora, "data"), run(lora, "greedy")
    np.testing.assert_allclose(data_loss, greedy_loss, rtol=1e-6)
    for k in data_sums:
        np.testing.assert_allclose(data_sums[k], greedy_sums[k], rtol=1e-6)
    matmuls = lambda target: str(jax.make_jaxpr(run, static_argnums=1)(lora, target)).count("dot_general")
    assert matmuls("data") < matmuls("greedy")  # no teacher layers


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A few random rows in train.prepare_data's shard format (no tokenizer needed)."""
    import json

    out = tmp_path_factory.mktemp("shards")
    rng, splits = np.random.default_rng(0), {}
    for split, rows in (("train", 8), ("eval", 2)):
        lengths = rng.integers(20, 33, rows).astype(np.int32)
        tokens = rng.integers(3, 49152, (rows, 32)).astype(np.int32)
        np.savez(out / f"{split}-00000.npz", tokens=tokens, loss_mask=np.ones((rows, 32), np.uint8), lengths=lengths)
        splits[split] = {"shards": [f"{split}-00000.npz"], "rows": rows}
    (out / "manifest.json").write_text(json.dumps({"format": "s3djax-token-shards/1", "vocab_size": 49152,
                                                   "splits": splits}))
    return str(out)


def test_a_tiny_soft_run_writes_a_draft_that_build_s2d_loads(data, tmp_path):
    from s3djax.methods import Options
    from s3djax.speculative.drafters.s2d_artifact import build as build_s2d
    from tiny import TINY, tiny_config, tiny_model
    from train.s2d import S2DTask, store_thresholds, train_nested

    m = tiny_model()
    cfg = tiny_config(data, str(tmp_path), exits="1,2", lora_rank=2, steps=12, eval_every=6, eval_batches=1,
                      batch_size=2, target="kl", anchor_fraction=0.25)
    result = train_nested(cfg, loaded=m, progress=False)
    warm = dataclasses.replace(cfg, init_from=result["path"])
    start = S2DTask.create(m, warm, 64).init_trainable(m, warm, jax.random.key(1))
    jax.tree.map(np.testing.assert_array_equal, start, {"lora": result["trainable"]["lora"]})
    assert S2DTask.create(m, dataclasses.replace(warm, target=""), 64).cfg.target == "data"  # the paper's labels
    deeper = dataclasses.replace(warm, exits="1,2,3")
    with pytest.raises(UserError, match="not an S2D nested draft of depth 3 and LoRA rank 2"):
        S2DTask.create(m, deeper, 64).init_trainable(m, deeper, jax.random.key(1))
    evals = [r for r in result["records"] if r["split"] == "eval"]
    trains = [r["loss"] for r in result["records"] if r["split"] == "train"]
    # Eight random rows teach nothing that carries to held-out rows: the training loss is what falls.
    assert len(evals[-1]["depth_acc"]) == 2 and np.mean(trains[-3:]) < 0.95 * np.mean(trains[:3])
    store_thresholds(result["path"], {"float32": [0.7]})
    ar = ARDecoder(TINY, 64, eos_ids=())
    built = build_s2d(m, ar, Options(draft_path=result["path"], max_draft=3), "float32", True)
    params, draft = built.params
    assert params is m.params and "layers" not in draft and built.warnings == []
    # On a CPU the draft reads int8 copies of its 2 layers, its adapters folded in; reading the target's, it keeps them.
    assert "lora" not in draft and sorted(draft["weights"]) == ["0", "1"]
    assert len(build_s2d(m, ar, Options(draft_path=result["path"], draft_weights="none"), "float32", True
                         ).params[1]["lora"]) == 2
    assert draft["thresholds"].tolist() == [pytest.approx(0.7)]
    assert built.decoder.drafter.exits == (1, 2) and "swept for float32" in built.draft
    assert "extra draft memory 0.0 MiB" in built.draft  # adapters only: a few KiB
    overridden = build_s2d(m, ar, Options(draft_path=result["path"], thresholds="0.2,0"), "float32", True)
    assert overridden.params[1]["thresholds"].tolist() == [pytest.approx(0.2)]
    with pytest.raises(UserError, match="train.s2d"):
        build_s2d(m, ar, Options(), "float32", True)
    with pytest.raises(UserError, match="not an s3djax s2d nested draft file"):
        build_s2d(m, ar, Options(draft_path=str(tmp_path / "checkpoints" / ".." / "config.json")), "float32", True)


def test_smollm2_s2d_equals_ar(smollm2):
    from s3djax import methods
    from s3djax.decode import Runner
    from s3djax.tokenizer import encode_prompt

    ar = methods.build("ar", smollm2, max_cache_len=128)
    s2d = methods.build("s2d", smollm2, max_cache_len=128, draft_path="none", thresholds="0.3,0.2,0", max_draft=3)
    assert "no trained nested draft" in s2d.warnings[0] and "untrained, exits 4,6,8" in s2d.draft
    ids = encode_prompt(smollm2.tokenizer, "What is the capital of France?", chat_template=True)
    expected = Runner(ar.decoder, ar.params).generate(ids, 24).tokens
    assert Runner(s2d.decoder, s2d.params).generate(ids, 24).tokens == expected


def test_the_shipped_draft_brings_its_measured_max_draft(smollm2):
    from s3djax import methods

    built = methods.build("s2d", smollm2, max_cache_len=128)
    # benchmarks/results/archive/s2d-multi-target-cpu-2026-11-23.md measured it fastest.
    assert built.decoder.drafter.tree.depth == 1 and "max draft 1" in built.draft
    assert "vocabulary 8192" in built.draft and built.params[1]["head"].shape == (8192, smollm2.config.hidden_size)
    assert methods.build("s2d", smollm2, max_cache_len=128, max_draft=3).decoder.drafter.tree.depth == 3
