"""The real embedded model against transformers reading the same GGUF (offline, fp32)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from s3djax import cache as kv
from s3djax import model, registry, tokenizer
from s3djax.bench_data import mt_bench


def mtbench_turns():
    return [turn for q in mt_bench() for turn in q["turns"]]


def test_config_read_from_the_gguf(smollm2):
    c = smollm2.config
    assert (c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
        30, 576, 1536, 9, 3, 64)
    assert (c.vocab_size, c.rope_theta, c.tie_word_embeddings, c.eos_token_ids) == (49152, 100000.0, True, (2,))


@pytest.mark.xdist_group("smollm2_hf")  # one worker loads transformers' copy (30 s) for both
def test_logits_match_transformers(smollm2, smollm2_hf):
    ids = tokenizer.encode_prompt(smollm2.tokenizer, mtbench_turns()[0], chat_template=True)[:96]
    tokens = jnp.asarray([ids], jnp.int32)
    n, s = len(ids), 128
    slots = jnp.zeros((1,), jnp.int32)
    decoder = model.Decoder(smollm2.config)

    @jax.jit
    def logits(params):
        variables = {"params": params}
        hidden, _ = decoder.apply(variables, tokens, jnp.arange(n)[None], kv.init_cache(smollm2.config, 1, s), slots,
                                  kv.causal_mask(slots, n, s))
        return decoder.apply(variables, hidden, method="logits")

    ours = np.asarray(logits(smollm2.params))[0]
    with torch.no_grad():
        ref = smollm2_hf(torch.tensor([ids])).logits[0].numpy()
    assert ref.std() > 1.0  # real logits, not a degenerate comparison
    np.testing.assert_allclose(ours, ref, atol=2e-3, rtol=0)


def test_tokenizer_matches_transformers_gguf_tokenizer(smollm2):
    from transformers import AutoTokenizer

    path = registry.lookup("smollm2-135m").path()
    ref = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    ours = smollm2.tokenizer
    texts = mtbench_turns() + ["In 2024, 12345 apples cost $3.50 <|im_end|>\n\n\tdéjà vu 😀"]
    for text in texts:
        assert ours(text)["input_ids"] == ref(text)["input_ids"], text
        assert ours.decode(ours(text)["input_ids"]) == text
    chat = [{"role": "user", "content": texts[0]}]
    assert tokenizer.encode_prompt(ours, texts[0], chat_template=True) == list(
        ref.apply_chat_template(chat, add_generation_prompt=True)["input_ids"])
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (1, 2, 2)


def test_loading_needs_no_torch():
    # The run-time path is gguf + NumPy + tokenizers; torch is only the tests' reference.
    import subprocess
    import sys

    code = "import sys; from s3djax.loading import load_model; load_model('smollm2-135m', progress=False); " \
           "print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_tabulate_describes_the_decoder(smollm2):
    table = model.Decoder(smollm2.config).tabulate(jax.random.key(0), *model.example_inputs(smollm2.config),
                                                   console_kwargs={"width": 200})
    assert "layers_29" in table and "Attention" in table and "MLP" in table
    total = sum(np.size(leaf) for leaf in jax.tree.leaves(smollm2.params))
    assert 134_000_000 < total < 135_000_000 and f"{total:,}" in table


def test_every_method_applies_the_targets_own_layer_arrays(smollm2):
    """No method copies the target's weights: each applies its arrays, or the one packed copy of them that
    every method shares where the CPU kernel runs."""
    from s3djax import methods, quant

    target = {id(leaf) for leaf in jax.tree.leaves(quant.pack_for_cpu(smollm2.params))}
    for method in ("s3d", "self-spec", "kangaroo", "s2d"):
        params, draft = methods.build(method, smollm2, max_cache_len=64).params
        assert {id(leaf) for leaf in jax.tree.leaves(params)} == target, method
        assert not target & {id(leaf) for leaf in jax.tree.leaves(draft)}, method
