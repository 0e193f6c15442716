"""Parity with transformers' PyTorch Llama and Phi-3, built from tiny local configs (no downloads).

Each case saves a randomly initialised transformers model with `save_pretrained`, so loading goes
through the real path (config.json + safetensors -> `load_hf_folder`), then compares logits.
"""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from s3djax import model, weights
from s3djax.cache import causal_mask, init_cache
from s3djax.config import ModelConfig
from s3djax.skip_plan import SkipPlan

ATOL = 1e-4
VOCAB = 256
LAYERS = 3
BATCH, SEQ = 2, 13

# Together per architecture: GQA and MHA, a non-power-of-two hidden size with derived head_dim,
# tied and untied heads, plus llama3 RoPE scaling (Llama) and partial rotary (Phi-3).
CASES = {
    "llama-gqa-d96-llama3-tied": ("llama", dict(
        hidden_size=96, intermediate_size=160, num_attention_heads=6, num_key_value_heads=2,
        tie_word_embeddings=True,
        # With head_dim 16 and theta 1e4 the wavelengths run 6..2e4, so original_max 256 puts
        # frequencies in all three llama3 bands (kept, smoothed, divided by factor).
        rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=256))),
    "llama-mha-d64-headdim32-untied": ("llama", dict(
        # head_dim given explicitly and != hidden/heads: q/o projections are not square.
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4, head_dim=32,
        tie_word_embeddings=False, rms_norm_eps=1e-6,
        rope_parameters=dict(rope_type="default", rope_theta=500000.0))),
    "phi3-gqa-d80-partial-untied": ("phi3", dict(
        hidden_size=80, intermediate_size=128, num_attention_heads=5, num_key_value_heads=1,
        tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))),
    "phi3-gqa-d64-tied": ("phi3", dict(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=True,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
}


@functools.partial(jax.jit, static_argnames=("config", "plan"))
def _step(params, tokens, positions, cache, slots, mask, *, config, plan=None):
    """forward + logits under one jit: half the compiles, which dominate this file's runtime."""
    decoder, variables = model.Decoder(config, plan), {"params": params}
    hidden, cache = decoder.apply(variables, tokens, positions, cache, slots, mask)
    return decoder.apply(variables, hidden, method="logits"), cache


def _hf_config(arch, overrides, num_layers=LAYERS):
    cls = transformers.Phi3Config if arch == "phi3" else transformers.LlamaConfig
    # Phi3Config defaults pad/eos to 32000, outside a 256-token vocabulary (the embedding asserts).
    # initializer_range 0.1 instead of 0.02: otherwise logits are ~1e-3 and a 1e-4 tolerance says nothing.
    return cls(vocab_size=VOCAB, num_hidden_layers=num_layers, initializer_range=0.1,
               pad_token_id=0, bos_token_id=1, eos_token_id=2, **overrides)


def _hf_model(hf_config):
    cls = transformers.Phi3ForCausalLM if hf_config.model_type == "phi3" else transformers.LlamaForCausalLM
    return cls(hf_config).float().eval()


@dataclasses.dataclass
class Checkpoint:
    name: str
    hf: object          # the transformers model (fp32, eval)
    path: str           # its save_pretrained folder
    config: ModelConfig
    params: dict


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def ckpt(request, tmp_path_factory):
    arch, overrides = CASES[request.param]
    torch.manual_seed(sum(map(ord, request.param)))
    hf = _hf_model(_hf_config(arch, overrides))
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, safe_serialization=True)
    config, params = weights.load_hf_folder(str(path))
    return Checkpoint(request.param, hf, str(path), config, params)


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, VOCAB, (BATCH, SEQ), dtype=np.int32)


def hf_logits(hf, tokens, positions=None):
    with torch.no_grad():
        kwargs = {} if positions is None else {"position_ids": torch.tensor(np.array(positions), dtype=torch.long)}
        return hf(input_ids=torch.tensor(np.array(tokens), dtype=torch.long), **kwargs).logits.float().numpy()


def full_forward(params, config, tokens, positions=None, plan=None, dtype=jnp.float32):
    """One causal pass over all tokens from an empty cache; returns (fp32 logits, cache)."""
    b, t = tokens.shape
    if positions is None:
        positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    slots = jnp.zeros(b, jnp.int32)
    logits, cache = _step(params, jnp.asarray(tokens), jnp.asarray(positions), init_cache(config, b, t, dtype),
                          slots, causal_mask(slots, t, t), config=config, plan=plan)
    return np.asarray(logits), cache


def max_diff(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


# --------------------------------------------------------------------------------- loading


def test_config_from_hf(ckpt):
    hf_cfg, c = ckpt.hf.config, ckpt.config
    assert c.arch == CASES[ckpt.name][0]
    assert (c.num_layers, c.num_heads, c.num_kv_heads) == (
        hf_cfg.num_hidden_layers, hf_cfg.num_attention_heads, hf_cfg.num_key_value_heads)
    assert c.tie_word_embeddings == hf_cfg.tie_word_embeddings
    assert ("lm_head" in ckpt.params) == (not c.tie_word_embeddings)
    # The RoPE frequencies are where llama3 scaling and partial rotary live: check them directly.
    np.testing.assert_allclose(c.rope_inv_freq(), ckpt.hf.model.rotary_emb.inv_freq.numpy(), rtol=1e-6)
    assert ModelConfig.from_hf(c.to_hf()) == c


def test_to_hf_tensors_round_trip(ckpt):
    # named_parameters skips buffers (rotary inv_freq) and lists a tied lm_head only once, as embed.
    expected = {k: v.detach().numpy() for k, v in ckpt.hf.named_parameters()}
    ours = weights.to_hf_tensors(ckpt.params, ckpt.config)
    assert set(ours) == set(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(ours[name], value, err_msg=name)
    again = weights.from_hf_tensors(ours.__getitem__, ckpt.config)
    chex.assert_trees_all_equal(again, ckpt.params)


def test_the_weight_mapping_names_every_hf_tensor_once(ckpt):
    # state_dict lists a tied lm_head under its own name too; the mapping reads it as the embedding.
    hf_names = set(ckpt.hf.state_dict()) - ({"lm_head.weight"} if ckpt.config.tie_word_embeddings else set())
    mapped = [name for name, _ in weights.hf_names(ckpt.config).values()]
    assert len(mapped) == len(set(mapped)) and set(mapped) == hf_names
    paths = {jax.tree_util.keystr(p, simple=True, separator="/") for p, _ in jax.tree_util.tree_leaves_with_path(ckpt.params)}
    assert paths == {"/".join(p) for p in weights.hf_names(ckpt.config)}


def test_decoder_init_gives_the_loaders_shapes(ckpt):
    shapes = lambda tree: jax.tree.map(lambda a: (a.shape, a.dtype), tree)
    assert shapes(model.init_params(ckpt.config, jax.random.key(0))) == shapes(ckpt.params)
    assert shapes(model.abstract_params(ckpt.config)) == shapes(ckpt.params)


# --------------------------------------------------------------------------------- logits


@pytest.mark.parametrize("offset", [0, 1000], ids=["pos0", "pos1000"])
def test_logits_match_transformers(ckpt, tokens, offset):
    # Offset positions make the low RoPE frequencies (the ones llama3 rescales) actually turn.
    positions = np.broadcast_to(np.arange(SEQ, dtype=np.int32) + offset, tokens.shape)
    expected = hf_logits(ckpt.hf, tokens, positions)
    ours, _ = full_forward(ckpt.params, ckpt.config, tokens, positions)
    assert expected.std() > 0.1, "logits too small for the tolerance to mean anything"
    print(f"{ckpt.name} offset={offset}: max |diff| {max_diff(ours, expected):.2e}, logit std {expected.std():.2f}")
    chex.assert_trees_all_close(ours, expected, atol=ATOL, rtol=0)


def test_to_hf_builds_the_same_transformers_model(ckpt, tokens):
    # The other direction: a transformers model from our config and tensors (what peers rely on).
    hf_dict = {k: v for k, v in ckpt.config.to_hf().items() if k not in ("architectures", "model_type")}
    cls = transformers.Phi3Config if ckpt.config.arch == "phi3" else transformers.LlamaConfig
    rebuilt = _hf_model(cls(**hf_dict))
    state = {k: torch.tensor(v) for k, v in weights.to_hf_tensors(ckpt.params, ckpt.config).items()}
    missing, unexpected = rebuilt.load_state_dict(state, strict=False)
    assert not unexpected
    assert set(missing) <= {"lm_head.weight"} and bool(missing) == ckpt.config.tie_word_embeddings
    chex.assert_trees_all_close(hf_logits(rebuilt, tokens), hf_logits(ckpt.hf, tokens), atol=ATOL, rtol=0)


def test_bf16_close_to_fp32(ckpt, tokens):
    _, params16 = weights.load_hf_folder(ckpt.path, jnp.bfloat16)
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(params16))
    ref, _ = full_forward(ckpt.params, ckpt.config, tokens)
    low, cache = full_forward(params16, ckpt.config, tokens, dtype=jnp.bfloat16)
    assert low.dtype == np.float32 and cache[0]["k"].dtype == jnp.bfloat16
    assert np.isfinite(low).all()
    agree = float(np.mean(low.argmax(-1) == ref.argmax(-1)))
    print(f"{ckpt.name} bf16: max |diff| {max_diff(low, ref):.3f} of logit std {ref.std():.2f}, argmax agree {agree:.2f}")
    assert agree >= 0.8
    assert max_diff(low, ref) < 0.1 * np.abs(ref).max()


# --------------------------------------------------------------------------------- KV cache


# A skipped attention sub-layer leaves its cache behind: decoding must still agree with the same plan's full pass.
PLANS = {"full": None, "skip1attn": "1.attn"}


@pytest.mark.parametrize("plan_spec", list(PLANS), ids=list(PLANS))
def test_prefill_then_decode_matches_full_forward(ckpt, tokens, plan_spec):
    config, params = ckpt.config, ckpt.params
    plan = PLANS[plan_spec] and SkipPlan.parse(PLANS[plan_spec], config.num_layers)
    expected, _ = full_forward(params, config, tokens, plan=plan)
    b, prefill, max_len = BATCH, 5, 16  # a cache longer than the sequence: unused slots must stay masked

    slots = jnp.zeros(b, jnp.int32)
    positions = np.broadcast_to(np.arange(prefill, dtype=np.int32), (b, prefill))
    logits, cache = _step(params, jnp.asarray(tokens[:, :prefill]), jnp.asarray(positions),
                          init_cache(config, b, max_len), slots, causal_mask(slots, prefill, max_len),
                          config=config, plan=plan)
    got = [np.asarray(logits)]
    for t in range(prefill, SEQ):
        slots = jnp.full(b, t, jnp.int32)
        logits, cache = _step(params, jnp.asarray(tokens[:, t:t + 1]), jnp.full((b, 1), t, jnp.int32), cache,
                              slots, causal_mask(slots, 1, max_len), config=config, plan=plan)
        got.append(np.asarray(logits))
    got = np.concatenate(got, axis=1)
    print(f"{ckpt.name} {plan_spec} decode: max |diff| {max_diff(got, expected):.2e}")
    chex.assert_trees_all_close(got, expected, atol=ATOL, rtol=0)


def test_right_padded_prefill_then_decode(ckpt):
    """Rows of different lengths share one padded prefill; junk K/V past each row's end is overwritten by decode."""
    config, params = ckpt.config, ckpt.params
    rng = np.random.default_rng(1)
    # Same shapes as the unpadded test (prefill 5, cache 16, 13 tokens in all), so nothing recompiles.
    lengths, padded, steps, max_len = np.array([2, 4], np.int32), 5, SEQ - 4, 16
    total = int(lengths.max()) + steps
    seq = rng.integers(0, VOCAB, (BATCH, total), dtype=np.int32)
    expected, _ = full_forward(params, config, seq)

    prompt = rng.integers(0, VOCAB, (BATCH, padded), dtype=np.int32)  # junk everywhere ...
    for row, n in enumerate(lengths):
        prompt[row, :n] = seq[row, :n]                                  # ... but the real prefix
    slots = jnp.zeros(BATCH, jnp.int32)
    positions = np.broadcast_to(np.arange(padded, dtype=np.int32), (BATCH, padded))
    prefill_logits, cache = _step(params, jnp.asarray(prompt), jnp.asarray(positions),
                                  init_cache(config, BATCH, max_len), slots, causal_mask(slots, padded, max_len),
                                  config=config)
    assert np.any(np.asarray(cache[0]["k"][0, padded - 1]) != 0), "junk should have been written past the length"
    prefill_logits = np.asarray(prefill_logits)
    for row, n in enumerate(lengths):
        chex.assert_trees_all_close(prefill_logits[row, :n], expected[row, :n], atol=ATOL, rtol=0)

    worst = 0.0
    for step in range(steps):
        pos = jnp.asarray(lengths + step)
        tok = seq[np.arange(BATCH), lengths + step][:, None]
        logits, cache = _step(params, jnp.asarray(tok), pos[:, None], cache, pos, causal_mask(pos, 1, max_len),
                              config=config)
        got = np.asarray(logits)[:, 0]
        want = expected[np.arange(BATCH), lengths + step]
        worst = max(worst, max_diff(got, want))
        chex.assert_trees_all_close(got, want, atol=ATOL, rtol=0)
    print(f"{ckpt.name} padded decode: max |diff| {worst:.2e}")


# --------------------------------------------------------------------------------- skip plans


def test_skipping_a_layer_matches_transformers_without_it(ckpt, tokens):
    skipped = 1
    arch, overrides = CASES[ckpt.name]
    shorter = _hf_model(_hf_config(arch, overrides, num_layers=LAYERS - 1))
    prefix = f"model.layers.{skipped}."
    state = {}
    for name, value in ckpt.hf.state_dict().items():
        if name.startswith(prefix):
            continue
        if name.startswith("model.layers."):
            i, rest = name[len("model.layers."):].split(".", 1)
            name = f"model.layers.{int(i) - (int(i) > skipped)}.{rest}"
        state[name] = value
    shorter.load_state_dict(state, strict=True)

    plan = SkipPlan.skipping_layers(LAYERS, [skipped])
    ours, cache = full_forward(ckpt.params, ckpt.config, tokens, plan=plan)
    expected = hf_logits(shorter, tokens)
    assert max_diff(expected, hf_logits(ckpt.hf, tokens)) > 1e-2, "skipping the layer should change the logits"
    print(f"{ckpt.name} skip layer: max |diff| {max_diff(ours, expected):.2e}")
    chex.assert_trees_all_close(ours, expected, atol=ATOL, rtol=0)
    assert not np.any(np.asarray(cache[skipped]["k"])), "a skipped layer's cache must stay untouched"


@pytest.mark.parametrize("part", ["attn", "mlp"])
def test_skipping_a_sublayer_matches_transformers_with_it_zeroed(ckpt, tokens, part, monkeypatch):
    # Both decoder layers add the sub-layer's output to the residual, so a sub-layer that returns
    # zeros is exactly a skipped one.
    layer = 1
    hf_layer = ckpt.hf.model.layers[layer]
    if part == "attn":
        monkeypatch.setattr(hf_layer.self_attn, "forward", lambda hidden_states, **_: (torch.zeros_like(hidden_states), None))
    else:
        monkeypatch.setattr(hf_layer.mlp, "forward", lambda hidden_states: torch.zeros_like(hidden_states))
    expected = hf_logits(ckpt.hf, tokens)
    monkeypatch.undo()
    assert max_diff(expected, hf_logits(ckpt.hf, tokens)) > 1e-2, "zeroing the sub-layer should change the logits"

    plan = SkipPlan.parse(f"{layer}.{part}", LAYERS)
    ours, cache = full_forward(ckpt.params, ckpt.config, tokens, plan=plan)
    print(f"{ckpt.name} skip {layer}.{part}: max |diff| {max_diff(ours, expected):.2e}")
    chex.assert_trees_all_close(ours, expected, atol=ATOL, rtol=0)
    for i, layer_cache in enumerate(cache):
        written = bool(np.any(np.asarray(layer_cache["k"]))) and bool(np.any(np.asarray(layer_cache["v"])))
        assert written == (part == "mlp" or i != layer), f"layer {i} cache written={written}"


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_directly_built_config_round_trips_through_hf(arch):
    # Configs are static jit arguments: a spurious difference would mean a second compile.
    c = ModelConfig(arch=arch, vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=8, eos_token_ids=(2,))
    assert ModelConfig.from_hf(c.to_hf()) == c
    assert hash(ModelConfig.from_hf(c.to_hf())) == hash(c)
