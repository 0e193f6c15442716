"""Hugging Face peers for the benchmark: transformers' own greedy decoders on exactly our weights.

    model = hf_model(load_model("smollm2-135m"))
    run = peer("hf-early-exit", model, exit_layer=tune_exit_layer(model, [ids], range(4, 30, 4)))
    run(ids, 128)  # {"tokens", "decode_s", "ttft_s", "total_s"}

`hf-ar` is `generate`; `hf-early-exit` is its LayerSkip-style self-speculation (the first L layers
plus the final norm and head draft, the whole model verifies); `hf-prompt-lookup` drafts n-gram
continuations copied from the context. All three are lossless greedy decoders, so in fp32 they emit
our AR tokens. The weights come from our params, not from transformers' GGUF reader, so the peers
run the same numbers we do, and are written once as safetensors because building a model from
params each run costs a conversion while `from_pretrained` on a local folder is fast.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import tempfile
import time
from typing import Callable

import numpy as np

from s3djax import user_cache
from s3djax.errors import UserError

PEERS = ("hf-ar", "hf-early-exit", "hf-prompt-lookup")
LOOKUP_TOKENS = 10  # transformers' default and documented example for prompt lookup


def unavailable() -> str | None:
    """Why the peers cannot run here, or None: they need torch, which only the dev set-up installs."""
    for module in ("torch", "transformers"):
        try:
            importlib.import_module(module)
        except ImportError as e:
            return f"Hugging Face peers need {module} ({e}): run `pip install {module}`"
    return None


def cache_dir(loaded) -> str:
    """The user's cache folder (`s3djax.user_cache`)/hf/<name>-<fingerprint>.

    The fingerprint hashes the config and a strided sample of every tensor rather than the source
    file's name or mtime: the same name may come from another file, dtype or requantization, and
    any of those moves the sampled values. On CPU it reads a few MB and takes milliseconds.
    """
    h = hashlib.sha1(repr(loaded.config.replace(attention="xla")).encode())
    import jax

    for leaf in jax.tree.leaves(loaded.params):
        h.update(np.ascontiguousarray(np.asarray(leaf).reshape(-1)[::4099]).tobytes())
    return user_cache.path("hf", f"{os.path.basename(loaded.name)}-{h.hexdigest()[:12]}")


def _write(loaded, folder: str) -> None:
    from safetensors.numpy import save_file

    from s3djax import weights

    tensors = {k: np.ascontiguousarray(v) for k, v in weights.to_hf_tensors(loaded.params, loaded.config).items()}
    if any(v.dtype != np.float32 for v in tensors.values()):
        raise UserError("Hugging Face peers need float weights; load the model without quantization")
    # Written beside the target and renamed, so an interrupted run never leaves a half folder to load.
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(folder), prefix=".tmp-")
    try:
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(loaded.config.to_hf(), f, indent=1)
        os.replace(tmp, folder)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.isfile(os.path.join(folder, "config.json")):  # not a concurrent writer's win
            raise


def hf_model(loaded, dtype=None, device: str = "cpu", threads: int | None = None):
    """A transformers LlamaForCausalLM holding `loaded`'s weights (fp32 unless `dtype`, a torch dtype).

    It stops where our decoder stops: its generation config takes the config's EOS ids and the
    tokenizer's, as `s3djax.methods` does. torch gets `threads` (default: every core, as JAX takes),
    process-wide; on a shared CPU fewer is faster, as OpenMP threads spin waiting for a busy core
    (measured: 2 threads 8x slower than 1 on 2 cores with one taken).
    """
    if loaded.config.arch != "llama":
        raise UserError(f"Hugging Face peers support Llama models, not {loaded.config.arch}")
    import torch
    from transformers import LlamaForCausalLM

    torch.set_num_threads(threads or os.cpu_count())
    folder = cache_dir(loaded)
    if not os.path.isfile(os.path.join(folder, "config.json")):
        _write(loaded, folder)
    model = LlamaForCausalLM.from_pretrained(folder, dtype=dtype or torch.float32).to(device).eval()
    tok = loaded.tokenizer
    model.generation_config.eos_token_id = list(loaded.eos_ids) or None
    model.generation_config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    return model


def peer(name: str, model, *, exit_layer: int | None = None, lookup_tokens: int = LOOKUP_TOKENS,
         ttft: bool = True, sampling=None) -> Callable[[list[int], int], dict]:
    """A greedy decoder `(prompt_ids, max_new_tokens) -> {tokens, decode_s, ttft_s, total_s}`.

    `tokens` are the new tokens, EOS included if produced. `total_s` is one `generate` call, prefill
    included; `ttft_s` is a separate 1-token `generate` with the same settings (None if `ttft` is
    off), and `decode_s` = total_s - ttft_s, the share our `Result.decode_s` measures (total_s
    without ttft). `hf-early-exit` drafts with the first `exit_layer` layers (default: half),
    `hf-prompt-lookup` with `lookup_tokens`; drafts follow transformers' defaults otherwise (up to 20
    tokens, stopping below 0.4 confidence for early exit). `sampling`, an `s3djax.sampling.Sampling`
    with a temperature, samples through transformers' own warpers instead.
    """
    import torch

    layers = model.config.num_hidden_layers
    if name == "hf-ar":
        options = {}
    elif name == "hf-early-exit":
        exit_layer = layers // 2 if exit_layer is None else exit_layer
        if not 0 < exit_layer < layers:
            raise UserError(f"the early-exit layer must be in 1..{layers - 1}, got {exit_layer}")
        options = {"assistant_early_exit": exit_layer}
    elif name == "hf-prompt-lookup":
        options = {"prompt_lookup_num_tokens": lookup_tokens}
    else:
        raise UserError(f"unknown peer {name!r}; choose from {', '.join(PEERS)}")
    if sampling is not None and not sampling.greedy:
        options.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k or None,
                       top_p=sampling.top_p)
    else:
        options.update(do_sample=False)
    device = model.device

    def generate(prompt, n):
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, **options)
        tokens = out[0, prompt.shape[1]:].tolist()  # .tolist() waits for the device
        return tokens, time.perf_counter() - t

    def run(prompt_ids: list[int], max_new_tokens: int) -> dict:
        prompt = torch.tensor([prompt_ids], device=device)
        first_s = generate(prompt, 1)[1] if ttft else None
        tokens, total_s = generate(prompt, max_new_tokens)
        return dict(tokens=tokens, ttft_s=first_s, total_s=total_s,
                    decode_s=total_s if first_s is None else max(total_s - first_s, 0.0))

    return run


def tune_exit_layer(model, prompts: list[list[int]], candidates, *, max_new_tokens: int = 32) -> int:
    """The early-exit layer among `candidates` with the least generate time over `prompts`.

    A shallow exit drafts cheaply but is rarely accepted, a deep one the reverse; where the balance
    lies depends on the model and the device, so it is measured, after one warm-up call.
    """
    candidates = list(candidates)
    if not candidates or not prompts:
        raise UserError("tuning the early-exit layer needs at least one candidate and one prompt")
    runs = {layer: peer("hf-early-exit", model, exit_layer=layer, ttft=False) for layer in candidates}
    runs[candidates[0]](prompts[0], 2)
    times = {layer: sum(run(p, max_new_tokens)["total_s"] for p in prompts) for layer, run in runs.items()}
    return min(times, key=times.get)
