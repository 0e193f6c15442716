"""llama.cpp peers for the benchmark: what a CPU user would run instead, on the same GGUF file.

    run = peer(model("llamacpp-q8_0", gguf_path, n_ctx=2048))
    run(ids, 128)  # {"tokens", "decode_s", "ttft_s", "total_s"}

`llamacpp-gguf` runs the file as it ships (SmolLM2's is Q4_1, the weights our float model dequantizes).
`llamacpp-f32` and `llamacpp-q8_0` run it requantized by llama.cpp's own quantizer, written once
beside the peers' other caches: F32 holds exactly our fp32 weights, Q8_0 is llama.cpp's int8 format
(32-weight blocks, with int8 activations). Greedy, on this process's cores, prompt tokens in, new tokens
out; decode time excludes the prompt's evaluation and first token, as ours does. llama-cpp-python is an
optional extra (`pip install -e ".[llamacpp]"`; it builds llama.cpp from source, about 6 minutes on 2 cores).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Callable

from s3djax import user_cache
from s3djax.errors import UserError

PEERS = ("llamacpp-gguf", "llamacpp-f32", "llamacpp-q8_0")
FTYPES = {"llamacpp-f32": "LLAMA_FTYPE_ALL_F32", "llamacpp-q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0"}


def unavailable() -> str | None:
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        return f"llama.cpp peers need llama-cpp-python ({e}): run `pip install -e \".[llamacpp]\"`"
    return None


def fails(name: str, source: str) -> str | None:
    """Why the peer `name` on `source` cannot run in this process, or None: llama-cpp-python missing, or the peer
    dying when it loads and decodes two tokens in a child process first. llama.cpp's CPU library picks its kernels
    by the CPU's features, and on some hosts one of them crashes the process (Q8_0 on an Intel Xeon with AMX under
    KVM); a benchmark that ran it in process would lose every column with it."""
    if why := unavailable():
        return why
    child = subprocess.run([sys.executable, "-m", "infer.llamacpp", name, source], capture_output=True, text=True,
                           timeout=600)
    if child.returncode == 0:
        return None
    if child.returncode < 0:
        return (f"llama.cpp crashed on this machine ({signal.Signals(-child.returncode).name} in a probe that "
                f"loads {name} and decodes 2 tokens)")
    return (child.stderr.strip().splitlines() or [f"exit code {child.returncode}"])[-1]


def gguf_for(name: str, source: str) -> str:
    """The GGUF a peer runs: `source` itself, or its requantized copy (made once)."""
    if name not in PEERS:
        raise UserError(f"unknown llama.cpp peer {name!r}; choose from {', '.join(PEERS)}")
    if name == "llamacpp-gguf":
        return source
    import llama_cpp

    stamp = f"{os.path.getsize(source)}-{int(os.path.getmtime(source))}"
    out = user_cache.path("llamacpp", f"{os.path.basename(source)[:-5]}-{stamp}-{name.split('-')[1]}.gguf")
    if not os.path.isfile(out):
        os.makedirs(os.path.dirname(out), exist_ok=True)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, FTYPES[name])
        params.allow_requantize = True
        params.nthread = os.cpu_count() or 1
        tmp = out + ".tmp"
        if llama_cpp.llama_model_quantize(source.encode(), tmp.encode(), params) != 0:
            raise UserError(f"llama.cpp could not requantize {source} for {name}")
        os.replace(tmp, out)  # an interrupted run never leaves half a file to load
    return out


def model(name: str, source: str, *, n_ctx: int, threads: int | None = None):
    """A llama_cpp.Llama on the peer's GGUF, on `threads` cores (default: all, as JAX takes)."""
    path = gguf_for(name, source)  # first: an unknown peer is named where llama-cpp-python is missing too
    import llama_cpp

    threads = threads or os.cpu_count() or 1
    return llama_cpp.Llama(path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                           verbose=False)


def peer(llm, eos_ids=()) -> Callable[[list[int], int], dict]:
    """A greedy decoder `(prompt_ids, max_new_tokens) -> {tokens, decode_s, ttft_s, total_s}`; `tokens`
    end at the first EOS (included), as ours do."""
    stop = set(eos_ids) | {llm.token_eos()}

    def run(prompt_ids: list[int], max_new_tokens: int) -> dict:
        # `generate` keeps the cached prefix that the new prompt shares, even with reset=True: a repeated prompt
        # would skip its evaluation. Forgetting the tokens first makes every run evaluate the whole prompt, as ours do.
        llm.reset()
        tokens, start = [], time.perf_counter()
        first = None
        for token in llm.generate(prompt_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                  reset=True):
            tokens.append(int(token))
            if first is None:
                first = time.perf_counter() - start
            if token in stop or len(tokens) >= max_new_tokens:
                break
        total = time.perf_counter() - start
        return dict(tokens=tokens, ttft_s=first, total_s=total, decode_s=total - (first or 0.0))

    return run


if __name__ == "__main__":  # `fails`'s probe: python -m infer.llamacpp PEER GGUF
    from s3djax.cli import run

    run(lambda: peer(model(sys.argv[1], sys.argv[2], n_ctx=64))([1, 2, 3], 2))
