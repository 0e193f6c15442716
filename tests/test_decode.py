"""The on-device AR loop: same tokens as recomputing from scratch and as transformers, compiled once."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from s3djax import cache as kv
from s3djax import decode
from s3djax import model
from s3djax.config import ModelConfig
from s3djax.decode import ARDecoder, Runner, bucket
from s3djax.errors import UserError
from s3djax.sampling import Sampling, process_logits, sample
from s3djax.tokenizer import encode_prompt

TINY = ModelConfig(arch="llama", vocab_size=97, hidden_size=48, intermediate_size=96, num_layers=3, num_heads=4,
                   num_kv_heads=2, head_dim=12, rope_theta=500.0)


def naive_greedy(params, config, prompt, n, width=64):
    """Greedy decoding that re-runs the whole sequence for every token: slow and obviously right.

    The sequence is padded to a fixed width (causal attention ignores what follows), so it compiles once.
    """

    @jax.jit
    def full_forward(seq):
        slots = jnp.zeros((1,), jnp.int32)
        decoder, variables = model.Decoder(config), {"params": params}
        hidden, _ = decoder.apply(variables, seq, jnp.arange(width)[None], kv.init_cache(config, 1, width), slots,
                                  kv.causal_mask(slots, width, width))
        return decoder.apply(variables, hidden[0], method="logits")

    seq = list(prompt)
    for _ in range(n):
        logits = full_forward(jnp.asarray([seq + [0] * (width - len(seq))]))
        seq.append(int(jnp.argmax(logits[len(seq) - 1])))
    return seq[len(prompt):]


@pytest.fixture(scope="module")
def tiny_params():
    # A larger init than 0.02 so the argmax is decided by the weights, not by noise.
    params = model.init_params(TINY, jax.random.key(1))
    return jax.tree.map(lambda a: a * 8 if a.ndim == 2 else a, params)


def test_loop_matches_naive_greedy_for_prompts_of_several_lengths(tiny_params):
    runner = Runner(ARDecoder(TINY, 64, eos_ids=()), tiny_params)
    outputs = set()
    for prompt in ([5], [3, 1, 4, 1, 5, 9, 2, 6], list(range(10, 30))):
        got = runner.generate(prompt, 12).tokens
        assert got == naive_greedy(tiny_params, TINY, prompt, 12)
        outputs.add(tuple(got))
    assert len(outputs) == 3  # the prompts steer the output: the comparison is not between constants


def test_eos_stops_the_loop_and_is_kept(tiny_params):
    reference = naive_greedy(tiny_params, TINY, [7, 8, 9], 10)
    eos = reference[4]
    got = Runner(ARDecoder(TINY, 64, eos_ids=(eos,)), tiny_params).generate([7, 8, 9], 10).tokens
    assert got == reference[:reference.index(eos) + 1]


def test_generation_stops_when_the_cache_is_full(tiny_params):
    result = Runner(ARDecoder(TINY, 20, eos_ids=()), tiny_params).generate(list(range(15)), 50)
    assert len(result.tokens) == 5
    with pytest.raises(UserError, match="prompt has 20 tokens but the cache holds 20"):
        Runner(ARDecoder(TINY, 20, eos_ids=()), tiny_params).generate(list(range(20)), 5)


def test_a_batch_decodes_each_row_as_it_decodes_alone(tiny_params):
    # Rows of different lengths, one stopping at its EOS and one at the cache's end, the others going on.
    prompts = [[5], [3, 1, 4, 1, 5, 9, 2, 6], list(range(10, 30)), list(range(40, 84))]
    eos = naive_greedy(tiny_params, TINY, prompts[1], 6)[3]
    runner = Runner(ARDecoder(TINY, 64, eos_ids=(eos,)), tiny_params)
    alone = [runner.generate(p, 30).tokens for p in prompts]
    assert len(alone[1]) <= 4 and len(alone[3]) == 64 - 44 and len({tuple(a) for a in alone}) == 4
    batch = runner.generate_batch(prompts, 30)
    assert [r.tokens for r in batch] == alone
    assert [r.prompt_tokens for r in batch] == [len(p) for p in prompts]


def test_a_sampled_batch_is_seeded_and_its_rows_differ(tiny_params):
    runner = Runner(ARDecoder(TINY, 64, eos_ids=(), sampling=Sampling(1.0)), tiny_params)
    a, b = ([r.tokens for r in runner.generate_batch([[1, 2, 3]] * 3, 10, seed=s)] for s in (0, 0))
    assert a == b and len({tuple(row) for row in a}) == 3


@pytest.mark.parametrize("cache", [200, 1000])
def test_decoding_past_several_key_blocks_matches_naive_recomputation(tiny_params, cache):
    # Caches over 128 slots attend over the occupied prefix in 128-key blocks (the last one clamped).
    prompt = [int(i) for i in np.random.default_rng(1).integers(0, TINY.vocab_size, 150)]
    got = Runner(ARDecoder(TINY, cache, eos_ids=()), tiny_params).generate(prompt, 40).tokens
    assert got == naive_greedy(tiny_params, TINY, prompt, 40, width=256)


def test_skip_plan_decodes_the_skipped_model(tiny_params):
    from s3djax.skip_plan import SkipPlan

    plan = SkipPlan.parse("1", 3)
    dropped = {**tiny_params, "layers_1": tiny_params["layers_2"]}
    del dropped["layers_2"]
    got = Runner(ARDecoder(TINY, 64, eos_ids=(), plan=plan), tiny_params).generate([4, 2], 8).tokens
    assert got == naive_greedy(dropped, TINY.replace(num_layers=2), [4, 2], 8)


def test_compiles_once_across_prompt_lengths_and_token_budgets(tiny_params):
    # The Runner's own executables (small ops elsewhere compile on first use, so XLA's count would vary).
    decode._EXECUTABLES.clear()  # the process shares them: another test may have compiled these
    runner = Runner(ARDecoder(TINY, 64, eos_ids=()), tiny_params)
    assert runner.generate([1, 2, 3], 5).compile_s > 0  # compiles a one-chunk start (bucket 16) and decode
    assert len(decode._EXECUTABLES) == 2
    runner.generate(list(range(1, 12)), 9, on_tokens=lambda t: None, chunk=3)  # same bucket, streamed
    runner.generate([4, 5], 2, seed=3)
    assert len(decode._EXECUTABLES) == 2, "a prompt in the same bucket or another token budget recompiled"
    runner.generate(list(range(1, 20)), 4)            # bucket 32: only its start compiles
    assert len(decode._EXECUTABLES) == 3
    # Another Runner of an equal decoder reuses them; weights of another dtype need their own.
    again = Runner(ARDecoder(TINY, 64, eos_ids=()), jax.tree.map(jnp.copy, tiny_params)).generate([1, 2, 3], 5)
    assert again.compile_s == 0.0 and len(decode._EXECUTABLES) == 3
    bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), tiny_params)
    assert Runner(ARDecoder(TINY, 64, eos_ids=()), bf16).generate([1], 2).compile_s > 0
    assert len(decode._EXECUTABLES) == 5
    assert bucket(19, 64) == 32 and bucket(3, 64) == 16 and bucket(60, 64) == 64


def test_streamed_chunks_equal_the_single_call(tiny_params):
    seen = []
    runner = Runner(ARDecoder(TINY, 64, eos_ids=()), tiny_params)
    streamed = runner.generate([9, 9, 9], 11, on_tokens=lambda t: seen.append(list(t)), chunk=4).tokens
    assert streamed == runner.generate([9, 9, 9], 11).tokens
    assert [len(s) for s in seen] == [1, 5, 9, 11] and seen[-1] == streamed


def test_sampling_is_seeded_and_respects_top_k_and_top_p(tiny_params):
    sampled = Runner(ARDecoder(TINY, 64, eos_ids=(), sampling=Sampling(1.0)), tiny_params)
    a, b, c = (sampled.generate([1, 2, 3], 10, seed=s).tokens for s in (0, 0, 1))
    assert a == b and a != c
    greedy = Runner(ARDecoder(TINY, 64, eos_ids=()), tiny_params).generate([1, 2, 3], 10).tokens
    for s in (Sampling(1.0, top_k=1), Sampling(1.0, top_p=1e-6)):
        assert Runner(ARDecoder(TINY, 64, eos_ids=(), sampling=s), tiny_params).generate([1, 2, 3], 10,
                                                                                           seed=5).tokens == greedy
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
    kept = lambda s: np.isfinite(np.asarray(process_logits(logits, s)))[0].tolist()
    assert kept(Sampling(1.0, top_k=2)) == [True, True, False, False]
    assert kept(Sampling(1.0, top_p=0.8)) == [True, True, False, False]
    assert kept(Sampling(1.0, top_p=0.81)) == [True, True, True, False]
    draws = sample(jnp.repeat(logits, 4000, axis=0), jax.random.key(0), Sampling(1.0))
    freq = np.bincount(np.asarray(draws), minlength=4) / 4000
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.03)


@pytest.mark.xdist_group("smollm2_hf")  # one worker loads transformers' copy (30 s) for both
def test_smollm2_greedy_matches_transformers_generate(smollm2, smollm2_hf):
    ids = encode_prompt(smollm2.tokenizer, "What is the tallest mountain in the world?", chat_template=True)
    ours = Runner(ARDecoder(smollm2.config, 256, eos_ids=(2,)), smollm2.params).generate(ids, 32).tokens
    with torch.no_grad():
        ref = smollm2_hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=2,
                                  pad_token_id=2)[0, len(ids):].tolist()
    assert ours == ref
    assert "Everest" in smollm2.tokenizer.decode(ours)


def test_a_long_prompt_is_prefilled_in_chunks_and_decodes_as_the_whole_sequence(tiny_params, monkeypatch):
    prompt = [(7 * i + 3) % 97 for i in range(45)]
    want = naive_greedy(tiny_params, TINY, prompt, 10)
    monkeypatch.setattr(decode, "PREFILL_CHUNK", 16)  # chunks of 16, 16 and 13 (bucketed to 16)
    runner = Runner(ARDecoder(TINY, 64, eos_ids=()), tiny_params)
    assert [int(c[2][0]) for c in runner._chunks(prompt, 0)] == [16, 16, 13]
    assert runner.generate(prompt, 10).tokens == want
    # Near the cache's end a chunk is cut to the slots left: a write past them would land on earlier slots.
    assert [c[0].shape[1] for c in Runner(ARDecoder(TINY, 38, eos_ids=()), tiny_params)._chunks(prompt[:37], 0)] == \
        [16, 16, 6]


def test_a_continued_prefill_reuses_the_cache_and_equals_the_sequence_from_scratch(tiny_params, monkeypatch):
    monkeypatch.setattr(decode, "PREFILL_CHUNK", 16)
    runner = Runner(ARDecoder(TINY, 96, eos_ids=()), tiny_params)
    first = runner.generate([5, 6, 7, 8, 9], 12, keep=True)
    # The next turn: the first turn's text (whose last token the cache does not hold yet) and 30 new tokens.
    history = [5, 6, 7, 8, 9] + first.tokens
    turn = history + [(11 * i + 2) % 97 for i in range(30)]
    reused = int(first.state["length"][0])
    assert reused == len(history) - 1
    got = runner.generate(turn, 10, prior=(first.state, reused))
    assert got.tokens == naive_greedy(tiny_params, TINY, turn, 10) == runner.generate(turn, 10).tokens
    assert first.tokens != got.tokens  # the turns differ: the comparison is not between constants


def test_a_bfloat16_cache_is_held_as_bits_and_updated_in_place_on_the_cpu(tiny_params):
    """XLA:CPU widens a bfloat16 dynamic-update-slice to fp32 and back, a copy of the whole cache a layer every step:
    the decode loop's body must neither convert nor copy the cache."""
    from cpu_kernels import matmul as cm

    if cm.unavailable() is not None:
        pytest.skip(f"CPU kernel: {cm.unavailable()}")
    d = ARDecoder(TINY, 64, eos_ids=(), cache_dtype="bfloat16")
    runner = Runner(d, tiny_params)
    state = runner.prefill([5, 6, 7])
    assert state["cache"][0]["k"].dtype == jnp.uint16
    shape = "{}[{}]".format("u16", ",".join(map(str, state["cache"][0]["k"].shape)))
    hlo = jax.jit(d.decode, donate_argnums=1).lower(tiny_params, state, jnp.int32(0)).compile().as_text()
    computation, offending = None, []
    for line in hlo.splitlines():
        if line and not line.startswith(" "):
            computation = line
        elif not computation.startswith("ENTRY") and (" convert(" in line or " copy(" in line) and \
                ("bf16[" + shape[4:] in line or "f32[" + shape[4:] in line or shape in line):
            offending.append(line.strip()[:120])
    assert offending == []
