"""Kangaroo: greedy output equals ar, verification from exit states equals the full forward, the adapter's
cache stays consistent across rejections, and the adapter trains, exports, loads and resumes."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s3djax import cache as kv
from s3djax import model
from s3djax.model import layer_key, with_layers
from s3djax.decode import ARDecoder, Runner
from s3djax.errors import UserError
from s3djax.methods import Options
from s3djax.speculative import draft_vocab, verify
from s3djax.speculative.draft_params import load_artifact, save_artifact
from s3djax.speculative.drafters.kangaroo import build as build_kangaroo
from s3djax.speculative.drafters.kangaroo import KangarooDrafter, adapter_hidden, init_adapter, shallow_plan
from s3djax.speculative.drafters.lookup import WithLookup
from s3djax.speculative.loop import SpecDecoder
from s3djax.speculative.tree import TreeSpec
from tiny import LLAMA, PHI3, random_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = os.path.join(ROOT, "configs", "drafts", "smollm2-135m-kangaroo.npz")
CACHE = 96


def noisy(tree, seed, scale):
    rng = np.random.default_rng(seed)  # NumPy: no small compilations per leaf shape
    return jax.tree.map(lambda a: jnp.asarray(np.asarray(a) + scale * rng.normal(size=a.shape), a.dtype), tree)


def near_oracle(params, config, exit_layer, seed):
    """A target whose layers >= l barely change the residual stream, and an adapter with a small attention
    output: the draft nearly is the target, so whole chains are accepted, with some rejections."""
    adapter = init_adapter(params, config, exit_layer)
    return (with_layers(params, {i: scaled_outputs(params[layer_key(i)], 0.05) for i in range(exit_layer, config.num_layers)}),
            {**adapter, "attn": {**adapter["attn"], "o": 0.05 * noisy(adapter["attn"]["o"], seed, 1.0)}})


def scaled_outputs(layer, factor):
    """A layer whose attention and MLP outputs are scaled by `factor` (both add to the residual stream)."""
    return {"attn": {"o": layer["attn"]["o"] * factor}, "mlp": {"down": layer["mlp"]["down"] * factor}}


def spec_decoder(config, exit_layer, tree, eta=0.0):
    return SpecDecoder.create(ARDecoder(config, CACHE, eos_ids=()), KangarooDrafter(config, tree, exit_layer, eta))


_ar = {}


def ar_runner(config, params):
    runner = _ar.setdefault(config, Runner(ARDecoder(config, CACHE, eos_ids=()), params))
    runner.params = params
    return runner


@pytest.mark.parametrize("config, exit_layer, tree, eta", [
    (LLAMA, 1, TreeSpec.chain(4), 0.0), (LLAMA, 3, TreeSpec.spine(3, 2), 0.1),
    (PHI3, 2, TreeSpec.spine(3, 3), 0.0)], ids=["llama-1-chain", "llama-3-top2", "phi3-2-top3"])
def test_greedy_kangaroo_equals_ar_on_tiny_models(config, exit_layer, tree, eta):
    random_target = random_params(config, 0)
    cases = {"random": (random_target, noisy(init_adapter(random_target, config, exit_layer), 1, 0.3)),
             "near-oracle": near_oracle(random_params(config, 1), config, exit_layer, 2)}
    spec, accepted = Runner(spec_decoder(config, exit_layer, tree, eta), None), 0
    for name, (params, adapter) in cases.items():
        spec.params = (params, adapter)
        for prompt in ([5], list(range(40, 57))):
            got = spec.generate(prompt, 30)
            assert got.tokens == ar_runner(config, params).generate(prompt, 30).tokens, (name, prompt)
            accepted += sum(got.stats["accepted_per_step"])
    assert accepted > 5  # drafts were accepted, so commit paths of every length ran


def test_a_batch_drafted_by_kangaroo_and_lookup_decodes_each_row_as_alone():
    # Lookup drafts a batch's step only where every row matches: Kangaroo's verification reads the exit states its
    # own draft left, so a row given way to while the others drafted by the model would verify stale ones.
    # A random adapter drafts other tokens than lookup's, so stale exit states would verify wrong ones.
    params = random_params(LLAMA, 0)
    adapter = noisy(init_adapter(params, LLAMA, 1), 1, 0.3)
    prompts = [[5], list(range(10, 20)) * 3, list(range(30, 50)), list(range(10, 20)) * 2]
    decoder = spec_decoder(LLAMA, 1, TreeSpec.chain(3))
    runner = Runner(SpecDecoder.create(decoder.ar, WithLookup(decoder.drafter, 2)), (params, adapter))
    want = [ar_runner(LLAMA, params).generate(p, 40).tokens for p in prompts]
    batch = runner.generate_batch(prompts, 40)
    assert [r.tokens for r in batch] == want
    assert sum(sum(r.stats["accepted_per_step"]) for r in batch) > 0


def test_a_draft_vocabulary_keeps_kangaroo_lossless():
    # The adapter drafts over every other token: the target's odd tokens can never be drafted.
    config, exit_layer, tree = LLAMA, 1, TreeSpec.spine(3, 2)
    params, adapter = near_oracle(random_params(config, 1), config, exit_layer, 2)
    adapter = draft_vocab.attach(adapter, {"vocab": list(range(0, config.vocab_size, 2))}, params)
    spec, accepted = Runner(spec_decoder(config, exit_layer, tree), (params, adapter)), 0
    for prompt in ([5], list(range(40, 57))):
        want = ar_runner(config, params).generate(prompt, 30).tokens
        got = spec.generate(prompt, 30)
        assert got.tokens == want and any(t % 2 for t in want), prompt
        accepted += sum(got.stats["accepted_per_step"])
    assert accepted > 5
    _, _, _, nodes, valid, _ = drafted(config, params, adapter, exit_layer, tree, [7, 1, 8, 2, 8])
    assert bool(valid.all()) and not np.any(np.asarray(nodes) % 2)  # eta = 0: all drafted, all from the vocabulary


def drafted(config, params, adapter, exit_layer, tree, prompt):
    """The state right after the prefill, and the first step's draft: (drafter, ar state, cache after drafting,
    nodes, valid, drafter state)."""
    decoder = spec_decoder(config, exit_layer, tree)

    @jax.jit
    def run(params, adapter):
        state = decoder.start((params, adapter), jnp.asarray([prompt], jnp.int32), jnp.asarray([len(prompt)]),
                              jax.random.key(0))
        return state, *decoder.drafter.draft(params, adapter, state["cache"], state["length"], state["last"],
                                             state["drafter"], None, decoder.ar.sampling)
    state, nodes, valid, _, cache, dstate = run(params, adapter)
    return decoder.drafter, state, cache, nodes, valid, dstate


@pytest.mark.parametrize("config, exit_layer", [(LLAMA, 2), (PHI3, 1)], ids=["llama", "phi3"])
def test_verification_from_exit_states_equals_the_full_forward(config, exit_layer):
    params = random_params(config, 3)
    adapter = noisy(init_adapter(params, config, exit_layer), 4, 0.3)
    tree = TreeSpec.spine(3, 2)
    drafter, state, cache, nodes, valid, dstate = drafted(config, params, adapter, exit_layer, tree, [7, 1, 8, 2, 8])
    assert bool(valid.all())  # eta = 0: every node was drafted
    length = state["length"]
    ours, ours_cache = jax.jit(lambda *a: drafter.score(*a, tree.arrays(1)))(params, cache, length, state["last"], nodes,
                                                                             dstate)
    full, full_cache = jax.jit(lambda *a: verify.score(*a, config=config, tree=tree.arrays(1)))(
        params, state["cache"], length, state["last"], nodes)
    np.testing.assert_allclose(ours, full, rtol=1e-4, atol=1e-4)
    # Every layer's K/V of every node is the full forward's: the shallow ones were written while drafting.
    end = int(length[0]) + tree.num_nodes
    for a, b in zip(ours_cache, full_cache):
        for name in ("k", "v"):
            np.testing.assert_allclose(a[name][:, :end], b[name][:, :end], rtol=1e-4, atol=1e-5)


def recomputed_adapter_cache(config, params, adapter, exit_layer, tokens):
    """The adapter's K/V over a whole committed sequence, from scratch: layers 0..l-1, then the adapter."""
    t = len(tokens)
    zeros, positions = jnp.zeros((1,), jnp.int32), jnp.arange(t, dtype=jnp.int32)[None]
    mask = kv.causal_mask(zeros, t, t)
    shallow, variables = model.Decoder(config, shallow_plan(config.num_layers, exit_layer)), {"params": params}
    x = shallow.apply(variables, jnp.asarray([tokens]), method="embed_tokens")
    exits, _ = shallow.apply(variables, x, positions, kv.init_cache(config, 1, t), zeros, mask, method="run_layers")
    return adapter_hidden(adapter, exits, kv.init_cache(config, 1, t)[0], positions, zeros, mask, config=config)[1]


@pytest.mark.parametrize("tree, switch", [(TreeSpec.spine(3, 2), 0), (TreeSpec.chain(3), 1)], ids=["top2", "chain-lookup"])
def test_the_adapter_cache_stays_consistent_across_rejections_and_full_acceptance(tree, switch):
    # A top-2 tree: the committed path may end in a leaf, whose adapter K/V came from its depth's block. With
    # lookup, the steps whose chain lookup drafted wrote theirs in `gave_way`.
    config, exit_layer, prompt = LLAMA, 2, [3, 1, 4, 1, 5, 9, 2, 6]
    params, adapter = near_oracle(random_params(LLAMA, 5), config, exit_layer, 6)
    decoder = spec_decoder(config, exit_layer, tree)
    if switch:
        decoder = SpecDecoder.create(decoder.ar, WithLookup(decoder.drafter, switch))
    state = jax.jit(decoder.start)((params, adapter), jnp.asarray([prompt], jnp.int32), jnp.asarray([len(prompt)]),
                                   jax.random.key(0))
    state = jax.jit(decoder.decode)((params, adapter), state, jnp.int32(40))
    steps = decoder.stats(state)["accepted_per_step"]
    assert tree.depth in steps and min(steps) < tree.depth, steps  # whole chains accepted, and some rejected
    length = int(state["length"][0])
    committed = prompt + np.asarray(state["tokens"])[0, :length - len(prompt)].tolist()
    expected = recomputed_adapter_cache(config, params, adapter, exit_layer, committed)
    got = (state["drafter"][0] if switch else state["drafter"])["adapter"]
    for name in ("k", "v"):
        np.testing.assert_allclose(got[name][:, :length], expected[name], rtol=1e-4, atol=1e-5)
    # And the target's own cache (shallow layers from drafting, deep ones from verification) is the full model's.
    _, full = model.forward_sequence(params, jnp.asarray([committed]), config=config)
    for a, b in zip(state["cache"], full):
        np.testing.assert_allclose(a["k"][:, :length], b["k"], rtol=1e-4, atol=1e-5)


def test_the_kangaroo_builder_refuses_bad_adapters_and_exit_layers(tmp_path):
    from s3djax.loading import LoadedModel
    from s3djax.speculative.draft_params import save_artifact

    m = LoadedModel("tiny-llama", LLAMA, random_params(LLAMA, 0), None, 0.0)
    ar = ARDecoder(LLAMA, CACHE, eos_ids=())
    with pytest.raises(UserError, match="no shipped Kangaroo adapter: train one with `python -m train.kangaroo`"):
        build_kangaroo(m, ar, Options(), "float32", True)
    built = build_kangaroo(m, ar, Options(draft_path="none", exit_layer=3, tree="top2", max_draft=3), "float32", True)
    assert built.decoder.drafter.exit_layer == 3 and built.decoder.drafter.tree == TreeSpec.spine(3, 2)
    assert "untrained" in built.warnings[0]
    path = str(tmp_path / "a.npz")
    save_artifact(path, init_adapter(m.params, LLAMA, 2), {"method": "kangaroo", "exit_layer": 2})
    assert build_kangaroo(m, ar, Options(draft_path=path), "float32", True).decoder.drafter.exit_layer == 2
    for opts, message in ((Options(draft_path=path, exit_layer=1), "trained for exit layer 2, not --exit-layer 1"),
                          (Options(draft_path="none", exit_layer=4), "exit layer must be in 1..3"),
                          (Options(draft_path=path, tree="tree-8"), "its tree must be chain or topK"),
                          (Options(draft_path=str(tmp_path / "no.npz")), "no such Kangaroo adapter file")):
        with pytest.raises(UserError, match=message):
            build_kangaroo(m, ar, opts, "float32", True)
    save_artifact(path, init_adapter(random_params(PHI3, 0), PHI3, 2), {"method": "kangaroo", "exit_layer": 2})
    with pytest.raises(UserError, match="not a Kangaroo adapter for a llama model"):
        build_kangaroo(m, ar, Options(draft_path=path), "float32", True)


def test_smollm2_kangaroo_from_the_cli_prints_what_ar_generates(smollm2):
    from s3djax import methods
    from s3djax.tokenizer import encode_prompt

    prompt, draft = "Name three primary colors.", SHIPPED if os.path.exists(SHIPPED) else "none"
    r = subprocess.run([sys.executable, "-m", "infer.generate", "--method", "kangaroo", "--draft", draft, "--tree", "top2",
                        "--max-draft", "4", "--prompt", prompt, "--max-new-tokens", "24", "--max-cache-len", "128",
                        "--json"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    ar = methods.build("ar", smollm2, max_cache_len=128)
    ids = encode_prompt(smollm2.tokenizer, prompt, chat_template=True)
    expected = Runner(ar.decoder, ar.params).generate(ids, 24).tokens
    assert out["text"] == smollm2.tokenizer.decode(expected, skip_special_tokens=True)
    assert out["method"] == "kangaroo" and out["new_tokens"] == len(expected) and out["verify_steps"] >= 1


def test_the_loss_is_the_teacher_entropy_when_the_draft_is_the_target():
    from train.kangaroo import kangaroo_loss

    # Layers >= l change nothing and the adapter adds nothing: draft and target distributions coincide.
    config, exit_layer = LLAMA, 2
    params, adapter = near_oracle(random_params(config, 9), config, exit_layer, 0)
    params = with_layers(params, {i: scaled_outputs(params[layer_key(i)], 0) for i in range(exit_layer, config.num_layers)})
    adapter = {**adapter, "attn": {**adapter["attn"], "o": 0 * adapter["attn"]["o"]}}
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (2, 24)), jnp.int32)
    batch = {"tokens": tokens, "loss_mask": jnp.ones_like(tokens), "lengths": jnp.asarray([24, 17])}
    loss, sums = jax.jit(lambda *a: kangaroo_loss(*a, config=config, exit_layer=exit_layer, num_positions=8))(
        adapter, params, batch, jax.random.key(0))
    assert float(sums["depth_correct"][0]) == float(sums["depth_count"][0]) == 16
    logits = jax.jit(lambda p: model.Decoder(config).apply(
        {"params": p}, model.forward_sequence(p, tokens, config=config)[0], method="logits"))(params)
    entropy = -jnp.sum(jax.nn.softmax(logits) * jax.nn.log_softmax(logits), -1)
    assert float(entropy.min()) - 1e-4 <= float(loss) <= float(entropy.max()) + 1e-4


def test_the_data_target_on_greedy_answers_is_the_greedy_target():
    from train.kangaroo import kangaroo_loss

    # On the target's own greedy continuation each next data token is the teacher's argmax, so the
    # teacher-free labels must give the same loss and agreement; a label off by one position would not.
    config, exit_layer = LLAMA, 2
    params, adapter = near_oracle(random_params(config, 3), config, exit_layer, 4)
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, config.vocab_size, 5)]
    tokens = jnp.asarray([prompt + list(ar_runner(config, params).generate(prompt, 27).tokens)], jnp.int32)
    answer = jnp.asarray([[0] * 5 + [1] * 27], jnp.int32)  # positions are drawn where the next token is the answer's
    batch = {"tokens": tokens, "loss_mask": answer, "lengths": jnp.asarray([32])}
    loss = {target: jax.jit(lambda *a, target=target: kangaroo_loss(
        *a, config=config, exit_layer=exit_layer, num_positions=12, target=target))(adapter, params, batch, jax.random.key(0))
        for target in ("data", "greedy")}
    (data_loss, data_sums), (greedy_loss, greedy_sums) = loss["data"], loss["greedy"]
    assert float(data_sums["depth_count"][0]) == 12 and 0 < float(data_sums["depth_correct"][0]) < 12
    assert float(data_sums["depth_correct"][0]) == float(greedy_sums["depth_correct"][0])
    np.testing.assert_allclose(float(data_loss), float(greedy_loss), rtol=1e-5)
    with pytest.raises(ValueError, match="unknown target 'nope'"):  # refused, not trained as a hard target
        kangaroo_loss(adapter, params, batch, jax.random.key(0), config=config, exit_layer=exit_layer, num_positions=12,
                      target="nope")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from train import prepare_data

    out = str(tmp_path_factory.mktemp("shards"))
    prepare_data.prepare("smollm2-135m", out, max_len=64, pack=True, eval_fraction=0.1, limit=80, progress=False)
    return out


def test_training_exports_an_adapter_that_loads_and_resumes(data, tmp_path):
    from tiny import TINY, tiny_config, tiny_model
    from train.kangaroo import train_adapter

    cfg = tiny_config(data, str(tmp_path / "run"), exit_layer=2, steps=4, save_every=2, eval_every=2)
    reference = train_adapter(tiny_config(data, str(tmp_path / "ref"), exit_layer=2, steps=4, save_every=2,
                                          eval_every=2), loaded=tiny_model(), progress=False)

    class Stop(Exception):
        pass

    def stop(step):
        if step == 2:  # after step 2's checkpoint
            raise Stop
    with pytest.raises(Stop):
        train_adapter(cfg, loaded=tiny_model(), progress=False, on_step=stop)
    resumed = train_adapter(cfg, loaded=tiny_model(), progress=False)
    jax.tree.map(np.testing.assert_array_equal, resumed["trainable"], reference["trainable"])
    evals = [r["loss"] for r in resumed["records"] if r["split"] == "eval"]
    assert evals[-1] < evals[0], evals

    m = tiny_model()
    from train.kangaroo import KangarooTask

    # A config that names no target trains the paper's soft targets (Eq. 3), as the artifact records.
    warm = tiny_config(data, str(tmp_path / "warm"), exit_layer=2, init_from=resumed["path"], target="")
    assert KangarooTask.create(m, warm, 64).target == load_artifact(resumed["path"], np.float32)[1]["target"] == "kl"
    start = KangarooTask.create(m, warm, 64).init_trainable(m, warm, jax.random.key(0))
    jax.tree.map(np.testing.assert_array_equal, start, resumed["trainable"])
    save_artifact(str(tmp_path / "other.npz"), {"attn_norm": {"scale": np.ones(3, np.float32)}}, {})
    wrong = tiny_config(data, str(tmp_path / "wrong"), exit_layer=2, init_from=str(tmp_path / "other.npz"))
    with pytest.raises(UserError, match="other.npz is not a Kangaroo adapter"):
        KangarooTask.create(m, wrong, 64).init_trainable(m, wrong, jax.random.key(0))

    built = build_kangaroo(m, ARDecoder(TINY, 64, eos_ids=()), Options(draft_path=resumed["path"]), "float32", True)
    assert built.decoder.drafter.exit_layer == 2 and "4 steps" in built.draft
    got = Runner(built.decoder, built.params).generate([1, 2, 3], 12).tokens
    assert got == Runner(ARDecoder(TINY, 64, eos_ids=()), m.params).generate([1, 2, 3], 12).tokens


def test_the_shipped_adapter_brings_its_measured_eta_max_draft_and_tree(smollm2):
    from s3djax import methods

    built = methods.build("kangaroo", smollm2, max_cache_len=128)
    drafter = built.decoder.drafter
    # benchmarks/results/archive/kangaroo-eta-cpu-2026-11-24.md and lookup-drafters-cpu-2026-11-26/ measured these fastest,
    # the chain giving way to lookup on the CPU.
    assert (drafter.eta, drafter.tree.depth, drafter.tree.spine_width) == (0.0, 2, 1)
    assert "eta 0.0, max draft 2 (the draft file's max draft" in built.draft and "tree chain" in built.draft
    assert "lookup where 1+ tokens match" in built.draft
    drafter = methods.build("kangaroo", smollm2, max_cache_len=128, eta=0.5, max_draft=3, tree="chain").decoder.drafter
    assert (drafter.eta, drafter.tree.depth, drafter.tree.spine_width) == (0.5, 3, 1)  # the flags override the file
    # A file that records no tree drafts the chain (the S2D draft records none).
    assert methods.build("s2d", smollm2, max_cache_len=128).decoder.drafter.tree.spine_name == "chain"


def test_a_paused_step_leaves_the_adapter_cache_a_drafted_step_would():
    # The pause gate's step drafts nothing; the next draft still reads the adapter's K/V for its token, which
    # `pause` writes as the first block of a drafted step would.
    from s3djax.sampling import GREEDY

    params = random_params(LLAMA, 0)
    drafter = KangarooDrafter(LLAMA, TreeSpec.chain(3), exit_layer=1, eta=0.0)
    adapter = noisy(init_adapter(params, LLAMA, 1), 1, 0.05)
    state = Runner(SpecDecoder.create(ARDecoder(LLAMA, CACHE, eos_ids=()), drafter), (params, adapter)).prefill(
        [3, 1, 4, 1, 5, 9, 2, 6])
    length, last, slot = state["length"], state["last"], int(state["length"][0])
    paused = drafter.pause(params, adapter, state["cache"], length, last, state["drafter"])["adapter"]
    drafted = drafter.draft(params, adapter, state["cache"], length, last, state["drafter"], None, GREEDY)[-1]["adapter"]
    for name in ("k", "v"):
        np.testing.assert_allclose(paused[name][:, :slot + 1], drafted[name][:, :slot + 1], rtol=1e-5, atol=1e-6)
        assert not np.allclose(paused[name][:, slot], state["drafter"]["adapter"][name][:, slot])  # it was written
