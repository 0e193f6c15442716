"""int8 weights: the rounding, the forward on quantized params, save/load, and lossless S3D with an int8 verifier."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels import matmul as cm
from s3djax import cache as kv
from s3djax import model, quant, weights
from s3djax.decode import ARDecoder, Runner
from s3djax.loading import load_model
from s3djax.skip_plan import SkipPlan
from s3djax.speculative import tree as trees
from s3djax.speculative.draft_params import init_draft
from s3djax.speculative.drafters.s3d import S3DDrafter
from s3djax.speculative.loop import SpecDecoder
from tests.tiny import LLAMA, PHI3, random_params


def test_rounding_is_symmetric_per_output_channel_and_within_half_a_step():
    w = np.random.default_rng(0).normal(size=(48, 20)).astype(np.float32)
    w[:, 3] = 0.0                    # an all-zero channel must not divide by zero
    w[5, 7] = -4 * np.abs(w).max()   # an outlier widens only its own channel's step
    q = quant.quantize(w, channel_axis=1)
    assert q.values.dtype == np.int8 and q.scale.shape == (20,)
    assert np.abs(q.values).max() == 127 and q.values[5, 7] == -127
    err = np.abs(np.asarray(quant.dequantize(q)) - w)
    assert (err <= q.scale / 2 + 1e-7).all() and (err[:, 3] == 0).all()
    assert q.scale[3] == 1 and q.scale[7] > 3 * np.delete(q.scale, [3, 7]).max()
    rows = quant.quantize(w.T, channel_axis=0)  # a [V, D] table: a scale per row
    np.testing.assert_array_equal(rows.values, q.values.T)
    np.testing.assert_array_equal(rows.scale, q.scale)


def _forward_logits(params, config, tokens):
    hidden = model.forward_sequence(params, tokens, config=config, cache_dtype=jnp.float32)[0]
    return model.Decoder(config).apply({"params": params}, hidden, method="logits")


@pytest.mark.parametrize("mode", ["int8", "int8-all"])
@pytest.mark.parametrize("config", [LLAMA, PHI3], ids=["llama", "phi3"])
def test_the_forward_reads_int8_as_the_float_model_of_its_dequantized_weights(config, mode):
    # init's own scale, not random_params's x8: the x8 model is chaotic and amplifies any rounding,
    # so its logit change would measure the random draw rather than the quantizer.
    params = model.init_params(config, jax.random.key(3))
    q = quant.apply(params, mode, jnp.float32)
    assert quant.mode_of(q) == mode
    dequantized = quant.dequantize_tree(q)
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, config.vocab_size)
    got, want = _forward_logits(q, config, tokens), _forward_logits(dequantized, config, tokens)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    # and int8 is a real change, though a small one, from the original weights
    original = _forward_logits(params, config, tokens)
    assert 0 < np.abs(got - original).max() < 0.05 * np.abs(original).max()


def test_the_pallas_kernel_and_xla_multiply_alike():
    w = quant.quantize(np.random.default_rng(1).normal(size=(64, 48)).astype(np.float32), 1)
    x = jax.random.normal(jax.random.key(2), (3, 5, 64))
    xla = quant.dot(x, quant.linear(w, "int8", jnp.float32, "xla"))
    pallas = quant.dot(x, quant.linear(w, "int8", jnp.float32, "pallas"))
    np.testing.assert_allclose(pallas, xla, rtol=1e-5, atol=1e-5)


def _ar_then_s3d(config, params, prompt, n):
    ar = ARDecoder(config, 128, eos_ids=())
    plan = SkipPlan.parse("1-2", config.num_layers)
    drafter = S3DDrafter(config, plan, trees.resolve("tree-8", 4), 4)
    draft = init_draft(params, config, plan, lora_rank=2)
    want = Runner(ar, params).generate(prompt, n).tokens
    got = Runner(SpecDecoder.create(ar, drafter), (params, draft)).generate(prompt, n)
    return want, got


@pytest.mark.parametrize("config", [LLAMA, PHI3], ids=["llama", "phi3"])
def test_s3d_is_lossless_against_its_int8_verifier(config):
    params = quant.apply(random_params(config, 5), "int8-all", jnp.float32)
    want, got = _ar_then_s3d(config, params, [3, 1, 4, 1, 5, 9, 2, 6], 40)
    assert got.tokens == want and got.stats["verify_steps"] > 1


def test_smollm2_quantized_on_load_saves_loads_back_and_decodes_losslessly(smollm2, tmp_path):
    from infer.quantize import main as quantize_cli
    from s3djax import methods
    from s3djax.tokenizer import encode_prompt

    quantize_cli(["--model", "smollm2-135m", "--quant", "int8", "--out", str(tmp_path / "int8")])
    m = load_model(str(tmp_path / "int8"), progress=False)
    assert m.quant == "int8" and isinstance(m.params["layers_0"]["attn"]["q"], quant.Int8Weight)
    # Quantized on load from the GGUF, saved and read back: equal to quantizing the float model.
    want = quant.apply(smollm2.params, "int8", jnp.float32)
    assert jax.tree.structure(m.params) == jax.tree.structure(want)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(m.params), jax.tree.leaves(want)))
    assert m.tokenizer.encode("Hello there") == smollm2.tokenizer.encode("Hello there")
    linears = sum(w.size for layer in model.layers_of(smollm2.params) for part in ("attn", "mlp")
                  for w in layer[part].values())
    assert quant.param_bytes(smollm2.params) - quant.param_bytes(m.params) > 2.9 * linears

    ids = encode_prompt(m.tokenizer, "Name three primary colors.", chat_template=True)
    ar = Runner(methods.build("ar", m, max_cache_len=128).decoder, m.params).generate(ids, 24)
    s3d = methods.build("s3d", m, max_cache_len=128, draft_path=smollm2_draft())
    got = Runner(s3d.decoder, s3d.params).generate(ids, 24)
    assert got.tokens == ar.tokens and got.stats["verify_steps"] >= 1
    assert "Red" in m.tokenizer.decode(ar.tokens)


def smollm2_draft():
    from s3djax import registry

    return registry.lookup("smollm2-135m").draft_path()


def test_a_foreign_quantized_checkpoint_is_refused(tmp_path):
    import json

    from s3djax.errors import UserError

    (tmp_path / "config.json").write_text(json.dumps({**LLAMA.to_hf(), "quantization_config": {"quant_method": "gptq"}}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(UserError, match="quantized with 'gptq'"):
        weights.open_hf_folder(str(tmp_path))


@pytest.mark.parametrize("config", [LLAMA, PHI3], ids=["llama", "phi3"])
def test_the_gpu_layout_holds_the_same_model(config):
    # [out, in] linears (what methods.build lays out on a GPU) read as the [in, out] ones: same logits, same greedy
    # decode; int8 weights and the [V, D] tables are left as they are, and a weight met twice is transposed once.
    config = config.replace(cpu_kernel=False)
    params = random_params(config, 4)
    attn = params["layers_0"]["attn"]
    laid = quant.lay_out_for_gpu({**params, "again": {n: attn[n] for n in ("o", "q", "k", "v", "qkv") if n in attn}})
    again = laid.pop("again")
    qkv = laid["layers_0"]["attn"]["qkv"]  # Phi-3's own, or a Llama's q, k and v joined
    assert set(laid["layers_0"]["attn"]) == {"qkv", "o"} and isinstance(qkv, quant.Transposed)
    assert again["qkv"] is qkv and again["o"] is laid["layers_0"]["attn"]["o"]  # laid out once
    assert qkv.shape == (config.hidden_size, (config.num_heads + 2 * config.num_kv_heads) * config.head_dim)
    gate_up = laid["layers_0"]["mlp"]["gate_up"]  # Phi-3's own, or a Llama's gate and up joined
    assert set(laid["layers_0"]["mlp"]) == {"gate_up", "down"} and gate_up.shape == (config.hidden_size, 2 * config.intermediate_size)
    assert not isinstance(laid["embed"], quant.Transposed)
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, config.vocab_size)
    np.testing.assert_allclose(_forward_logits(laid, config, tokens), _forward_logits(params, config, tokens), rtol=1e-5, atol=1e-5)
    decoder = ARDecoder(config, 32, eos_ids=())
    prompt = [5, 9, 2, 7, 11]
    assert Runner(decoder, laid).generate(prompt, 12).tokens == Runner(decoder, params).generate(prompt, 12).tokens
    int8 = quant.apply(params, "int8", jnp.float32)
    assert quant.lay_out_for_gpu(int8)["layers_0"] == int8["layers_0"]
    # A draft's adapters on q, k, v, gate and up (b nonzero, as trained) apply to the joined weights' parts as they did apart
    plan = SkipPlan.parse("1-2", config.num_layers)
    keys = iter(jax.random.split(jax.random.key(7), 1000))
    lora = jax.tree_util.tree_map_with_path(
        lambda path, x: jax.random.normal(next(keys), x.shape, x.dtype) if path[-1] == jax.tree_util.DictKey("b") else x,
        init_draft(params, config, plan, lora_rank=2)["lora"])

    def draft_hidden(p, lora):
        b, t = tokens.shape
        cache, zeros = kv.init_cache(config, b, t), jnp.zeros((b,), jnp.int32)
        positions = jnp.broadcast_to(jnp.arange(t), (b, t))
        return model.Decoder(config, plan).apply({"params": p}, tokens, positions, cache, zeros,
                                                 kv.causal_mask(zeros, t, t), lora=lora)[0]
    plain = draft_hidden(params, lora)
    # The joined products sum in another order: on a Zen 3 (XLA's AVX2 dot) one element of 720 was 1.1e-5 off at 1e-5.
    # 1e-4 still tells a misapplied adapter, which moves the draft by more than 1e-3 (below).
    np.testing.assert_allclose(draft_hidden(laid, lora), plain, rtol=1e-4, atol=1e-4)
    assert np.abs(plain - draft_hidden(params, None)).max() > 1e-3  # the adapters change the draft here


@pytest.mark.skipif(not cm.usable(), reason="the CPU matmul kernel does not run here")
@pytest.mark.parametrize("mode", ["none", "int8"])
def test_the_cpu_layout_joins_a_llamas_products_and_keeps_every_bit(mode, monkeypatch):
    # pack_for_cpu joins q, k and v, and gate and up (one kernel call each instead of three and two). Each output column
    # is still one fma chain over K, so the logits are those of the products apart, bit for bit. Widths of whole panels.
    config = LLAMA.replace(hidden_size=64, head_dim=16, intermediate_size=128, cpu_kernel=True)
    params = random_params(config, 4)
    params = params if mode == "none" else quant.apply(params, mode, jnp.float32)
    joined = quant.pack_for_cpu({**params, "again": params["layers_0"]})
    again, layer = joined.pop("again"), joined["layers_0"]
    assert set(layer["attn"]) == {"qkv", "o"} and set(layer["mlp"]) == {"gate_up", "down"}
    assert isinstance(layer["attn"]["qkv"], quant.Packed) and layer["mlp"]["gate_up"].shape == (64, 256)
    assert again["attn"]["qkv"] is layer["attn"]["qkv"]  # a layer met twice is joined and packed once
    monkeypatch.setattr(quant, "_join_for_cpu", lambda ws: None)
    apart = quant.pack_for_cpu(params)
    assert set(apart["layers_0"]["attn"]) == {"q", "k", "v", "o"}
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, config.vocab_size)
    assert (np.asarray(_forward_logits(joined, config, tokens)) == np.asarray(_forward_logits(apart, config, tokens))).all()
