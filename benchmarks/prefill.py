"""Time to first token on long prompts, and decode speed after them, against llama.cpp on the same CPU and GGUF.

    python -m benchmarks.prefill [--tokens 1000,4000,8000] [--methods ar,s3d,kangaroo] [--repeats 2]

Each prompt asks for a summary of a document made of held-out ShareGPT text, cut to the given number of tokens
with the chat template (both sides get the same token ids). Ours: the time from the prompt's ids to the first
token on the host, compile excluded, for fp32 and `--quant int8-all`, and the speculative methods' draft prefill
on top of `ar`'s; llama.cpp (llama-cpp-python): F32 and Q8_0 on the model's GGUF, the same ids, its time to the
first generated token. Then `--new-tokens` greedy tokens: decode tokens/s at that context (ours and llama.cpp's, both
from the first token on). Runs are interleaved and the fastest of `--repeats` kept. Memory: the process's peak
resident set after each size, and the KV cache's bytes.
"""

from __future__ import annotations

import dataclasses
import resource
import time

import numpy as np

from benchmarks import report
from s3djax import device
from s3djax.tokenizer import encode_prompt

REQUEST = "\n\nSummarize the text above in three sentences."


def document(tokenizer, tokens: int) -> str:
    """Held-out ShareGPT first turns joined until they hold `tokens` tokens."""
    from s3djax.bench_data import sharegpt_heldout

    parts, have = [], 0
    for _, text in sharegpt_heldout():
        parts.append(text)
        have += len(tokenizer.encode(text, add_special_tokens=False))
        if have > tokens + 64:
            break
    return "\n\n".join(parts)


def long_prompt(tokenizer, tokens: int, text: str) -> list[int]:
    """The chat-templated summary request of `text` cut so that the ids number `tokens` (or a few fewer)."""
    body = tokenizer.encode(text, add_special_tokens=False)
    keep = tokens
    for _ in range(4):  # the template's tokens around the document, and the cut's re-tokenization, settle fast
        ids = encode_prompt(tokenizer, tokenizer.decode(body[:keep]) + REQUEST, True)
        if len(ids) <= tokens and tokens - len(ids) < 8:
            return ids
        keep -= len(ids) - tokens + (1 if len(ids) > tokens else 0)
    return ids[:tokens]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    from infer import llamacpp
    from s3djax.cli import Parser
    from s3djax.generator import Generator
    from s3djax.registry import DEFAULT_MODEL

    p = Parser(prog="python -m benchmarks.prefill", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="1000,4000,8000", help="prompt sizes, comma-separated")
    p.add_argument("--methods", default="ar,s3d,kangaroo", help="our methods at fp32 (ar first)")
    p.add_argument("--quant", default="int8-all", help="a quantized ar as well ('none': skip)")
    p.add_argument("--kv-dtype", default="bfloat16",
                   help="ar and the quantized ar over a KV cache of this dtype as well, as llama.cpp's is f16 ('none': skip)")
    p.add_argument("--peers", default="llamacpp-f32,llamacpp-q8_0", help="llama.cpp peers ('none': skip)")
    p.add_argument("--max-cache-len", type=int, default=8192)
    p.add_argument("--new-tokens", type=int, default=64, help="tokens decoded after each prompt")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    sizes = [int(t) for t in args.tokens.split(",")]
    methods = args.methods.split(",")
    p.check(args, repeats=args.repeats >= 1, methods=methods[0] == "ar", new_tokens=args.new_tokens >= 2,
            tokens=all(1 < n < args.max_cache_len for n in sizes))
    peers = [] if args.peers == "none" else args.peers.split(",")

    gen = Generator(DEFAULT_MODEL, method="ar", max_cache_len=args.max_cache_len)
    for name in list(peers):
        if why := llamacpp.fails(name, gen.source.path):
            print(f"note: {name}'s column is skipped: {why}")
            peers.remove(name)
    ours = {m: gen.session(m).runner for m in methods}
    quantized = None if args.quant == "none" else \
        Generator(DEFAULT_MODEL, method="ar", max_cache_len=args.max_cache_len, quant=args.quant)
    if quantized:
        ours[f"ar {args.quant}"] = quantized.session("ar").runner
    kv = f"kv-{args.kv_dtype}"
    if args.kv_dtype != "none":  # the same loaded weights over the other cache
        ours[f"ar {kv}"] = gen.session("ar", kv_dtype=args.kv_dtype).runner
        if quantized:
            ours[f"ar {args.quant} {kv}"] = quantized.session("ar", kv_dtype=args.kv_dtype).runner
    def timed(result) -> tuple[float, float]:  # (time to first token, decode tokens/s after it)
        return result.ttft_s, result.tokens_per_s

    def timed_peer(r: dict) -> tuple[float, float]:
        return r["ttft_s"], (len(r["tokens"]) - 1) / r["decode_s"] if r["decode_s"] > 0 else 0.0

    # An EOS would end a decode early: every run must decode the same tokens, so none is an end here.
    for runner in ours.values():
        runner.decoder = dataclasses.replace(runner.decoder, eos_ids=()) if hasattr(runner.decoder, "eos_ids") else \
            dataclasses.replace(runner.decoder, ar=dataclasses.replace(runner.decoder.ar, eos_ids=()))
    runs = {name: (lambda ids, r=r: timed(r.generate(ids, args.new_tokens))) for name, r in ours.items()}
    for name in peers:
        run = llamacpp.peer(llamacpp.model(name, gen.source.path, n_ctx=args.max_cache_len), ())
        runs[name] = lambda ids, run=run: timed_peer(run(ids, args.new_tokens))

    text = document(gen.tokenizer, max(sizes))
    cache_mb = 2 * gen.config.num_layers * args.max_cache_len * gen.config.num_kv_heads * gen.config.head_dim * 4 / 2**20
    rows = []
    for n in sizes:
        ids = long_prompt(gen.tokenizer, n, text)
        best, rate = {name: float("inf") for name in runs}, {name: 0.0 for name in runs}
        for r in range(args.repeats):
            for name, run in runs.items():
                ttft, tps = run(ids)
                best[name], rate[name] = min(best[name], ttft), max(rate[name], tps)
                print(f"  {len(ids)} tokens, round {r + 1}: {name} {ttft:.3f} s, {tps:.1f} tokens/s", flush=True)
        rows.append((len(ids), best, rate, peak_rss_mb()))

    names = list(runs)
    head = ["prompt tokens", *[f"{n} TTFT s" for n in names]]
    ratios = []
    for ours_f32, ours_q in (("ar", f"ar {args.quant}"), (f"ar {kv}", f"ar {args.quant} {kv}")):
        if ours_f32 in runs and "llamacpp-f32" in runs:
            ratios.append((ours_f32, "llamacpp-f32"))
        if ours_q in runs and "llamacpp-q8_0" in runs:
            ratios.append((ours_q, "llamacpp-q8_0"))
    head += [f"{a} / {b}" for a, b in ratios] + [f"{m} / ar" for m in methods[1:]] + ["peak RSS MB"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    decode = [n for n in names if n not in methods[1:]]  # the speculative methods' decode is the family table's
    dhead = ["prompt tokens", *[f"{n} decode tok/s" for n in decode], *[f"{a} / {b}" for a, b in ratios]]
    dlines = ["| " + " | ".join(dhead) + " |", "|" + " --- |" * len(dhead)]
    for n, best, rate, rss in rows:
        cells = [str(n), *[f"{best[k]:.3f}" for k in names]]
        cells += [f"{best[a] / best[b]:.2f}x" for a, b in ratios]
        cells += [f"{best[m] / best['ar']:.3f}x" for m in methods[1:]]
        lines.append("| " + " | ".join(cells + [f"{rss:.0f}"]) + " |")
        dcells = [str(n), *[f"{rate[k]:.1f}" for k in decode], *[f"{rate[a] / rate[b]:.2f}x" for a, b in ratios]]
        dlines.append("| " + " | ".join(dcells) + " |")
    notes = [f"# Time to first token on long prompts ({time.strftime('%Y-%m-%d')})", "",
             f"- device: {device.describe()}; ours fp32 unless named, `--max-cache-len {args.max_cache_len}` "
             f"(KV cache {cache_mb:.0f} MB fp32), greedy; fastest of {args.repeats} interleaved runs",
             "- prompt: a summary request of held-out ShareGPT text, chat template, the same ids for every column; "
             "TTFT: prompt ids in, first new token on the host, compile excluded",
             "- llama.cpp: llama-cpp-python on the model's GGUF requantized to F32 / Q8_0, all cores, its default f16 KV "
             "cache; its TTFT is `generate` up to the first token", "", "## Time to first token", "", *lines, "",
             f"## Decode after the prompt ({args.new_tokens} tokens, greedy, no EOS)", "", *dlines, ""]
    report.write(args.out, f"prefill-{time.strftime('%Y-%m-%d')}", "\n".join(notes))


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
