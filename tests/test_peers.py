"""Hugging Face peers: our weights in transformers, cached as safetensors, greedy tokens equal to ours."""

import os
import types

import numpy as np
import pytest

from s3djax.decode import ARDecoder, Runner
from s3djax.errors import UserError
from s3djax.tokenizer import encode_prompt

peers = pytest.importorskip("infer.peers")
pytest.importorskip("torch")

# A copying prompt: prompt lookup finds its drafts in it, and the answer ends with EOS in 12 tokens.
PROMPTS = {"sky": ("Why is the sky blue?", 8),
           "copy": ("Repeat exactly: the quick brown fox jumps over the lazy dog.", 16)}


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("s3djax-cache"))


@pytest.fixture(scope="module")
def hf(smollm2, cache_root):
    import torch

    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("S3DJAX_CACHE", cache_root)
        # One thread: a test run may share its cores, and spinning OpenMP threads then crawl.
        yield peers.hf_model(smollm2, threads=1)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ours(smollm2):
    eos = tuple(smollm2.config.eos_token_ids)
    runner = Runner(ARDecoder(smollm2.config, 128, eos_ids=eos, pad_id=smollm2.tokenizer.pad_token_id), smollm2.params)
    return lambda ids, n: runner.generate(ids, n).tokens


def test_without_torch_the_peers_say_why(monkeypatch):
    assert peers.unavailable() is None

    def no_torch(name):
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(peers.importlib, "import_module", no_torch)
    assert peers.unavailable() == "Hugging Face peers need torch (No module named 'torch'): run `pip install torch`"


def test_the_second_model_loads_from_the_cached_folder(smollm2, hf, cache_root, monkeypatch):
    monkeypatch.setenv("S3DJAX_CACHE", cache_root)
    folder = peers.cache_dir(smollm2)
    assert folder.startswith(os.path.join(cache_root, "hf", "smollm2-135m-"))
    assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors"]
    monkeypatch.setattr(peers, "_write", lambda *a: pytest.fail("converted again instead of loading the cache"))
    again = peers.hf_model(smollm2, threads=1)
    np.testing.assert_array_equal(again.model.layers[3].self_attn.q_proj.weight.detach().numpy(),
                                  np.asarray(smollm2.params["layers_3"]["attn"]["q"]).T)
    np.testing.assert_array_equal(again.lm_head.weight.detach().numpy(), np.asarray(smollm2.params["embed"]))
    assert again.generation_config.eos_token_id == [2]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_every_peer_decodes_our_greedy_tokens(smollm2, hf, ours, prompt):
    text, n = PROMPTS[prompt]
    ids = encode_prompt(smollm2.tokenizer, text, chat_template=True)
    want = ours(ids, n)
    for name in peers.PEERS:
        got = peers.peer(name, hf, exit_layer=15)(ids, n)
        assert got["tokens"] == want, name
        assert got["total_s"] > 0 and got["ttft_s"] > 0 and got["decode_s"] >= 0
    if prompt == "copy":
        assert want[-1] == 2 and len(want) < n  # stopped at EOS, as ours does


def test_exit_layer_tuning_picks_the_fastest_and_bad_settings_are_user_errors(smollm2, hf, monkeypatch):
    ids = encode_prompt(smollm2.tokenizer, PROMPTS["sky"][0], chat_template=True)
    real = peers.peer

    def slowed(name, model, exit_layer=None, **kw):  # the candidate named slow takes a second longer, however fast
        run = real(name, model, exit_layer=exit_layer, **kw)
        return lambda p, n: (lambda r: {**r, "total_s": r["total_s"] + (1.0 if exit_layer == slow else 0.0)})(run(p, n))

    monkeypatch.setattr(peers, "peer", slowed)
    for slow, fastest in ((6, 20), (20, 6)):
        assert peers.tune_exit_layer(hf, [ids], [6, 20], max_new_tokens=4) == fastest
    monkeypatch.undo()
    with pytest.raises(UserError, match="early-exit layer must be in 1..29"):
        peers.peer("hf-early-exit", hf, exit_layer=30)
    with pytest.raises(UserError, match="unknown peer 'vllm'"):
        peers.peer("vllm", hf)
    with pytest.raises(UserError, match="support Llama models, not phi3"):
        peers.hf_model(types.SimpleNamespace(config=types.SimpleNamespace(arch="phi3")))
