"""`python -m infer.benchmark`: methods against `ar` on real prompt sets, in one process, with the S3D paper's metrics.

    python -m infer.benchmark --methods ar,s3d,hf-ar --dataset mt-bench --limit 5 --out benchmarks/results/run
    python -m infer.benchmark --methods "s3d@gamma=2|4+lookup=0|2,lookup@max-draft=2|3" --rounds 2 --out DIR

Every method decodes the same prompts greedily on the same device. Compilation and a warm-up run
come first; then each prompt runs every method in turn, the order rotating per prompt so that
drift (clocks, caches, other load) falls on all of them alike. A method may be given several times with
different options (`s3djax.options.variants`), so one run compares a method's settings against `ar`.
Writes DIR/results.json (every number), DIR/results.md (method x dataset, like the paper's Table 1),
DIR/acceptance.png and DIR/speed.png.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys

import numpy as np

from s3djax import quant
from s3djax.cli import Parser, run, sampling
from s3djax.config import default_attention
from s3djax.methods import METHODS
from s3djax.options import variant, variants
from s3djax.sampling import GREEDY

GREEDY_METHODS = tuple(f"{m}-greedy" for m in METHODS)
DEFAULT_METHODS = "ar,s3d,self-spec,kangaroo,s2d,lookup,hf-ar,hf-early-exit,hf-prompt-lookup"


def parse_args(argv=None):
    p = Parser(prog="python -m infer.benchmark", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="registry name, .gguf file or checkpoint folder")
    p.add_argument("--checkpoint", help="checkpoint folder for a registry shape such as llama-2-7b")
    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help="comma-separated: ar (the baseline, always run), s3d, self-spec, kangaroo, s2d, lookup; ar-xla (ar with "
                   "XLA's dot instead of the CPU matmul kernel); METHOD-greedy, such as ar-greedy or s3d-greedy (the method "
                   "decoding greedily whatever the sampling flags: what sampling costs it); the Hugging Face peers hf-ar, hf-early-exit, "
                   "hf-prompt-lookup (skipped with a note where torch is missing); and the llama.cpp peers "
                   "llamacpp-gguf, llamacpp-f32, llamacpp-q8_0 on the model's GGUF (skipped where llama-cpp-python is); "
                   "one of ours with options set, METHOD@FLAG=V+FLAG=V, each V may be a|b|c (every combination runs): "
                   "s3d@gamma=2|4+lookup=0")
    p.add_argument("--dataset", default="mt-bench", help="comma-separated: mt-bench, humaneval, sharegpt-heldout, and "
                   "Spec-Bench's tasks: mt-bench-multiturn (the second turn after the method's own first answer, on its "
                   "cache), summarization, qa (retrieval-style, over three passages), math (s3djax.bench_data)")
    p.add_argument("--mt-bench-turns", type=int, choices=(1, 2), default=1)
    p.add_argument("--limit", default=None, help="prompts per dataset (default: all): N for every set, or "
                   "DATASET=N pairs separated by commas (mt-bench=80,humaneval=40)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-cache-len", type=int, default=2048, help="prompts that do not fit with the budget are skipped")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--quant", choices=quant.MODES)
    p.add_argument("--matmul", choices=("xla", "pallas"), default="xla")
    p.add_argument("--attention", choices=("xla", "pallas"), help="default: pallas on a GPU, xla elsewhere")
    p.add_method_options(several=True)
    p.add_sampling()
    p.add_argument("--batch", type=int, default=1, help="prompts decoded together as one batch (each row's tokens/s "
                   "being its share of the batch's time), every method drafting in it, each row on its own cursor (a "
                   "Generator drafts in a batch where the speed model predicts it pays); the peers run one after "
                   "another")
    p.add_argument("--rounds", type=int, default=1, help="passes over the prompts")
    p.add_argument("--exit-layers", default="", help="hf-early-exit: exit layers to tune over (default: a few)")
    p.add_argument("--out", required=True, help="folder for results.json, results.md and the plots")
    args = p.parse_args(argv)
    args.methods = list(dict.fromkeys(["ar", *[v for m in args.methods.split(",") if m for v in variants(m)]]))
    args.dataset = [d for d in args.dataset.split(",") if d]
    limits = parse_limits(args.limit, args.dataset)
    p.check(args, limit=limits is not None, max_new_tokens=args.max_new_tokens >= 2, batch=args.batch >= 1,
            rounds=args.rounds >= 1)
    args.limit = limits
    args.attention = args.attention or default_attention()  # the report names what ran
    return args


def parse_limits(text: str | None, datasets: list[str]) -> dict | None:
    """`--limit`: prompts per dataset, "N" for every set or "SET=N,..." (None: all); None if invalid."""
    limits, ok = {}, True
    for item in text.split(",") if text is not None else ():
        name, eq, n = item.rpartition("=")
        ok &= n.isdigit() and int(n) >= 1 and (not eq or name in datasets)
        limits.update(dict.fromkeys([name] if eq else datasets, int(n) if n.isdigit() else 0))
    return limits if ok else None


# ------------------------------------------------------------------------------------------ metrics

def pooled_tokens_per_s(runs: list[dict]) -> float:
    decoded = sum(max(len(r["tokens"]) - 1, 0) for r in runs)
    decode_s = sum(r["decode_s"] for r in runs)
    return decoded / decode_s if decode_s > 0 else 0.0


def summarize(runs: list[dict], baseline: list[dict] | None, *, depth: int, memory_bytes: int,
              baseline_memory_bytes: int, greedy: bool = True) -> dict:
    """Aggregate one method's runs over a dataset.

    runs: per prompt {tokens, decode_s, ttft_s, accepted_per_step (speculative only)}, in the order
    of `baseline` (ar's runs on the same prompts, None for ar itself). tokens/s is pooled: new tokens
    after the first over total decode time, so long answers weigh as they cost. tau and alpha_k pool
    every verify step. M is the paper's memory-normalised speed: speedup / (memory / ar memory).
    `identical` (the share of outputs equal to ar's) is None when sampling: outputs then differ by
    design, and lossless means the same distribution.
    """
    from s3djax.speculative.loop import acceptance

    tps = pooled_tokens_per_s(runs)
    out = {"prompts": len(runs), "new_tokens": sum(len(r["tokens"]) for r in runs), "tokens_per_s": tps,
           "ttft_s": float(np.mean([r["ttft_s"] for r in runs if r["ttft_s"] is not None] or [np.nan])),
           "memory_bytes": memory_bytes}
    if baseline is not None:
        base_tps = pooled_tokens_per_s(baseline)
        out["speedup"] = tps / base_tps if base_tps else 0.0
        out["identical"] = float(np.mean([r["tokens"] == b["tokens"] for r, b in zip(runs, baseline)]))
    else:
        out["speedup"], out["identical"] = 1.0, 1.0
    if not greedy:
        out["identical"] = None
    out["memory_normalized_speedup"] = out["speedup"] / (memory_bytes / baseline_memory_bytes)
    steps = [a for r in runs for a in r.get("accepted_per_step", ())]
    if any("accepted_per_step" in r for r in runs):
        stats = acceptance(steps, depth)
        drafted = [d for r in runs for d in r.get("drafted_per_step", ())]
        paused = sum(r.get("paused_steps", 0) for r in runs)
        out.update(tau=stats["mean_accepted_tokens"], acceptance_by_depth=stats["acceptance_by_depth"],
                   verify_steps=stats["verify_steps"], mean_drafted=float(np.mean(drafted)) if drafted else None,
                   paused=paused / max(paused + stats["verify_steps"], 1))
    return out


# ------------------------------------------------------------------------------------------ running

def kv_cache_bytes(config, args) -> int:
    """A full --max-cache-len cache: ours is allocated whole, and a peer's grows toward it."""
    import jax.numpy as jnp

    per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * jnp.dtype(args.dtype).itemsize
    return per_token * args.max_cache_len


def method_options(args, name: str) -> dict:
    """One of our methods' (or its variant's) options and sampling; --skip is the drafts' plan here, never ar's."""
    from s3djax import methods

    method, overrides = variant(name)
    opts = methods.options(args, method)
    return {**opts, "skip": opts["skip"] if method != "ar" else "", **overrides, "sampling": sampling(args)}


class Method:
    """A method the benchmark times: a call runs one prompt; a batch runs several, one after another unless the
    method decodes batches; a conversation runs turns, each after the method's own answer to the one before."""

    def batch(self, rows, n):
        return [self(ids, n) for ids in rows]

    def conversation(self, tokenizer, turns, n):
        """One row for a multi-turn item (`joined`); each turn's prompt is the whole conversation so far."""
        from s3djax.tokenizer import encode_chat

        messages, rows = [], []
        for text in turns:
            messages.append({"role": "user", "content": text})
            rows.append(self(encode_chat(tokenizer, messages), n))
            messages.append({"role": "assistant", "content": tokenizer.decode(rows[-1]["tokens"], skip_special_tokens=True)})
        return joined(rows)


def joined(rows: list[dict]) -> dict:
    """A conversation's turns as one run: their tokens, decode time and verify steps together; the time to first
    token of the last turn (where a cache kept from the turns before shows)."""
    out = {"tokens": [t for r in rows for t in r["tokens"]], "decode_s": sum(r["decode_s"] for r in rows),
           "ttft_s": rows[-1]["ttft_s"], "compile_s": sum(r.get("compile_s", 0.0) for r in rows)}
    for key in ("accepted_per_step", "drafted_per_step"):
        if key in rows[0]:
            out[key] = [x for r in rows for x in r[key]]
    if "paused_steps" in rows[0]:
        out["paused_steps"] = sum(r["paused_steps"] for r in rows)
    return out


class JaxMethod(Method):
    """One of our decoders, built once on the Generator's weights; a run is a timed Runner.generate."""

    def __init__(self, name, gen, args, greedy: bool = False):

        options = method_options(args, name)
        session = gen.session(variant(name)[0], **(dict(options, sampling=GREEDY) if greedy else options))
        self.seed = args.seed
        self.warnings, self.about = session.warnings, session.about
        self.runner, self.session, self.gen = session.runner, session, gen
        decoder = session.built.decoder
        self.depth = decoder.drafter.tree.depth if hasattr(decoder, "drafter") else 0
        self.memory_bytes = quant.param_bytes(session.built.params) + kv_cache_bytes(gen.config, args)

    def __call__(self, ids, n):
        return self.row(self.runner.generate(ids, n, seed=self.seed))

    def conversation(self, tokenizer, turns, n):
        """A chat that keeps its cache: each turn prefills only what the cache lacks (`s3djax.generator.Chat`)."""
        from s3djax.generator import Chat

        chat, rows = Chat(self.gen, self.session, None, "stop"), []
        for text in turns:
            out = chat.send(text, n, seed=self.seed)
            decoded = max(len(out.token_ids) - 1, 0)
            rows.append({"tokens": out.token_ids, "ttft_s": out.ttft_s, "compile_s": out.compile_s,
                         "decode_s": decoded / out.tokens_per_s if out.tokens_per_s else 0.0,
                         **{k: out.stats[k] for k in ("accepted_per_step", "drafted_per_step", "paused_steps")
                            if k in out.stats}})
        return joined(rows)

    def batch(self, rows, n):
        """One batch, each row charged its share of the batch's decode time."""
        if len(rows) == 1:
            return super().batch(rows, n)
        return [{**self.row(r), "decode_s": r.decode_s / len(rows)}
                for r in self.runner.generate_batch(rows, n, seed=self.seed)]

    @staticmethod
    def row(r):
        return {"tokens": r.tokens, "decode_s": r.decode_s, "ttft_s": r.ttft_s, "compile_s": r.compile_s,
                **({k: r.stats[k] for k in ("accepted_per_step", "drafted_per_step", "paused_steps")} if r.stats else {})}


class LlamaCppMethod(Method):
    """A llama.cpp peer on the model's own GGUF; memory counts its file and a KV cache as long as ours."""

    def __init__(self, name, gguf, m, args):
        from infer import llamacpp

        llm = llamacpp.model(name, gguf, n_ctx=args.max_cache_len)
        self.run_peer = llamacpp.peer(llm, m.eos_ids)
        self.warnings, self.depth = [], 0
        path = llamacpp.gguf_for(name, gguf)
        self.about = f"llama-cpp-python {_version('llama_cpp')}, {os.path.basename(path)}"
        self.memory_bytes = os.path.getsize(path) + kv_cache_bytes(m.config, args)

    def __call__(self, ids, n):
        return self.run_peer(ids, n)


def _version(module: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(module.replace("_", "-") + ("-python" if module == "llama_cpp" else ""))
    except importlib.metadata.PackageNotFoundError:
        return "?"


class PeerMethod(Method):
    """A transformers peer; memory counts its parameters and a KV cache as long as ours."""

    def __init__(self, name, model, m, args, exit_layer=None):
        from infer import peers

        self.run_peer = peers.peer(name, model, exit_layer=exit_layer, sampling=sampling(args))
        self.warnings, self.depth = [], 0
        self.about = f"transformers, exit layer {exit_layer}" if exit_layer else "transformers"
        self.memory_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) + kv_cache_bytes(m.config, args)

    def __call__(self, ids, n):
        return self.run_peer(ids, n)


def build_methods(args, gen, prompts_for_tuning, notes):
    import dataclasses

    from infer import llamacpp, peers
    from s3djax.generator import Generator

    m, built, hf = gen.model, {}, []  # one transformers model serves every peer
    for name in args.methods:
        if variant(name)[0] in METHODS:
            built[name] = JaxMethod(name, gen, args)
        elif name in GREEDY_METHODS:
            method = name.removesuffix("-greedy")
            built[name] = JaxMethod(method, gen, args, greedy=True)
            built[name].about = f"{method} decoding greedily, whatever the sampling flags"
        elif name == "ar-xla":  # the same weights, unpacked, every product through XLA's dot
            xla = Generator.from_model(dataclasses.replace(m, config=m.config.replace(cpu_kernel=False)),
                                       dtype=args.dtype, max_cache_len=args.max_cache_len)
            built[name] = JaxMethod("ar", xla, args)
            built[name].about = "ar with XLA's dot for every product (no CPU matmul kernel)"
        elif name in llamacpp.PEERS:
            why = (llamacpp.fails(name, gen.source.path) if gen.source.path.endswith(".gguf") else
                   f"{gen.source.path} is not a GGUF file")
            if why:
                notes.append(f"{name} skipped: {why}")
                continue
            built[name] = LlamaCppMethod(name, gen.source.path, m, args)
        elif name in peers.PEERS:
            why = peers.unavailable()
            if why:
                notes.append(f"{name} skipped: {why}")
                continue
            if m.quant != "none":
                notes.append(f"{name} skipped: transformers runs the float model, not this {m.quant} one")
                continue
            if not hf:
                import jax
                import torch

                on_gpu = jax.default_backend() == "gpu" and torch.cuda.is_available()  # the peer on our device
                hf.append(peers.hf_model(m, dtype=torch.bfloat16 if args.dtype == "bfloat16" else None,
                                         device="cuda" if on_gpu else "cpu"))
            model = hf[0]
            exit_layer = None
            if name == "hf-early-exit":
                layers = m.config.num_layers
                candidates = ([int(x) for x in args.exit_layers.split(",")] if args.exit_layers else
                              sorted({max(1, layers // 4), layers // 2, (3 * layers) // 4}))
                exit_layer = peers.tune_exit_layer(model, prompts_for_tuning, candidates, max_new_tokens=32)
                notes.append(f"hf-early-exit: exit layer {exit_layer}, the fastest of {candidates} on "
                             f"{len(prompts_for_tuning)} prompts")
            built[name] = PeerMethod(name, model, m, args, exit_layer)
    return built


def room_needed(item: dict, tokenizer, max_new_tokens: int) -> int:
    """Cache slots an item may take: its prompt and answer, and each later turn (with the template's few tokens)
    and its answer."""
    later = item.get("turns", [])[1:]
    return len(item["ids"]) + max_new_tokens * (1 + len(later)) + sum(
        len(tokenizer.encode(t, add_special_tokens=False)) + 16 for t in later)


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=10).stdout.strip() or None
    except OSError:
        return None


def main(argv=None):
    args = parse_args(argv)
    import jax

    from infer import llamacpp, peers
    from s3djax import bench_data, device, progress
    from s3djax.errors import UserError
    from s3djax.generator import Generator

    known = METHODS + ("ar-xla",) + GREEDY_METHODS + peers.PEERS + llamacpp.PEERS
    unknown = [name for name in args.methods if variant(name)[0] not in known]
    if unknown:
        raise UserError(f"unknown method {unknown[0]!r}; choose from {', '.join(known)}")
    fixed = [name for name in args.methods if "@" in name and variant(name)[0] not in METHODS]
    if fixed:
        raise UserError(f"{fixed[0]!r}: only {', '.join(METHODS)} take options")
    gen = Generator(args.model, checkpoint=args.checkpoint, dtype=args.dtype, max_cache_len=args.max_cache_len,
                    quant=args.quant, matmul=args.matmul, attention=args.attention, load=False)
    for name in args.methods:  # every method's options, before the weights are read
        if variant(name)[0] in METHODS:
            gen.check(method=variant(name)[0], **method_options(args, name))
    notes, sets = [], {}
    for name in args.dataset:
        items = bench_data.prompts(name, gen.tokenizer, args.limit.get(name), mt_bench_turns=args.mt_bench_turns)
        fits = [p for p in items if room_needed(p, gen.tokenizer, args.max_new_tokens) <= args.max_cache_len]
        if len(fits) < len(items):
            notes.append(f"{name}: {len(items) - len(fits)} prompts skipped, longer than --max-cache-len "
                         f"{args.max_cache_len} less --max-new-tokens {args.max_new_tokens}")
        if not fits:
            raise UserError(f"no {name} prompt fits --max-cache-len {args.max_cache_len} with "
                            f"--max-new-tokens {args.max_new_tokens}")
        sets[name] = fits
    first = next(iter(sets.values()))
    m = gen.load()
    print(f"loaded {m.name} in {m.load_s:.1f} s; building {', '.join(args.methods)}...", file=sys.stderr, flush=True)
    methods = build_methods(args, gen, [p["ids"] for p in first[:2]], notes)
    if args.gamma is None and "s3d" in methods:  # recorded as it ran, for readers of results.json (benchmarks.projection)
        args.gamma = methods["s3d"].depth
    for method in methods.values():
        notes.extend(method.warnings)
    for name, method in methods.items():  # compile and warm up apart from the timed runs
        method(first[0]["ids"], 8)
    if args.batch > 1:
        for method in methods.values():  # the batch's own executables too
            method.batch([p["ids"] for p in first[:args.batch]], 8)
    runs = {d: {name: [] for name in methods} for d in sets}
    names = list(methods)
    with progress.bar(total=sum(map(len, sets.values())) * len(names) * args.rounds, desc="benchmark", unit="run") as bar:
        for d, items in [(d, items) for _ in range(args.rounds) for d, items in sets.items()]:
            for i, at in enumerate(range(0, len(items), args.batch)):
                group = items[at:at + args.batch]
                for name in names[i % len(names):] + names[:i % len(names)]:
                    bar.set_postfix_str(f"{d} {group[0]['id']} {name}")
                    if "turns" in group[0]:
                        rows = [methods[name].conversation(gen.tokenizer, p["turns"], args.max_new_tokens) for p in group]
                    else:
                        rows = methods[name].batch([p["ids"] for p in group], args.max_new_tokens)
                    runs[d][name].extend({"id": p["id"], "prompt_tokens": len(p["ids"]), **r} for p, r in zip(group, rows))
                    bar.update(len(group))
    ar_memory = methods["ar"].memory_bytes
    summary = {d: {name: summarize(r, None if name == "ar" else runs[d]["ar"], depth=methods[name].depth,
                                   memory_bytes=methods[name].memory_bytes, baseline_memory_bytes=ar_memory,
                                   greedy=args.temperature == 0)
                   for name, r in per.items()} for d, per in runs.items()}
    for d, per in summary.items():
        for name, s in per.items():
            if s["identical"] is not None and s["identical"] < 1.0:
                notes.append(f"MISMATCH: {name} on {d}: only {s['identical']:.0%} of outputs are identical to ar"
                             + (" (bfloat16 rounds a multi-token verify unlike a one-token step: "
                                "`python -m benchmarks.divergence` tells rounding near-ties from bugs)"
                                if args.dtype == "bfloat16" else ""))
                print(f"warning: {notes[-1]}", file=sys.stderr)
    record = {"device": device.describe(), "jax": jax.__version__, "commit": git_commit(),
              "date": datetime.date.today().isoformat(), "model": m.name, "quant": m.quant,
              "peak_device_bytes": device.memory_bytes("peak_bytes_in_use"),
              "settings": {k: v for k, v in vars(args).items() if k != "out"},
              "methods": {name: method.about for name, method in methods.items()},
              "notes": notes, "summary": summary, "runs": runs}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(record, f, indent=1)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(markdown(record) + "\n")
    plots(record, args.out)
    print(markdown(record))
    print(f"wrote {args.out}/results.json, results.md, acceptance.png, speed.png", file=sys.stderr)


# ------------------------------------------------------------------------------------------ reports

def markdown(record: dict) -> str:
    s = record["settings"]
    decoding = "greedy" if not s["temperature"] else (f"sampled at temperature {s['temperature']}, top-k {s['top_k']}, "
                                                      f"top-p {s['top_p']}, seed {s['seed']}")
    batch = s.get("batch", 1)
    lines = [f"# Benchmark: {record['model']}, {', '.join(record['summary'])}", "",
             f"- device: {record['device']}",
             f"- date: {record['date']}; commit {record['commit']}",
             f"- {decoding}, {s['max_new_tokens']} new tokens at most, cache {s['max_cache_len']}, {s['dtype']}, "
             f"weights {record['quant']}, attention {s['attention']}"
             + (f"; s3d: gamma {s['gamma']}, tree {s['tree'] or 'chain'}" if s["gamma"] is not None else ""),
             *([f"- {s['rounds']} rounds over the prompts (prompts counts every run)"] if s.get("rounds", 1) > 1 else []),
             *([f"- batches of {batch} prompts: each of our methods decodes each as one batch, drafting in it; the "
                "peers one prompt after another; tokens/s is over the batches' decode time"] if batch > 1 else []),
             *[f"- {name}: {about}" for name, about in record["methods"].items() if about],
             *[f"- note: {n}" for n in record["notes"]], "",
             "tokens/s: new tokens after the first over decode time, pooled over prompts; speedup: against `ar` "
             "in this run; tau: tokens per verify step, bonus included; drafted: draft depth per step; paused: the share "
             "of steps that drafted nothing (the pause gate); M: speedup / (memory / ar memory), memory "
             "being parameters plus KV cache; identical: outputs equal to `ar`'s (greedy only: sampled outputs "
             "differ by design, and lossless then means the same distribution).", "",
             "| dataset | method | prompts | tokens/s | speedup | tau | drafted | paused | alpha_1..k | M | TTFT ms | memory MiB | identical |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for d, per in record["summary"].items():
        for name, r in per.items():
            alphas = r.get("acceptance_by_depth", [])
            alpha = " / ".join(f"{a:.2f}" for a in alphas[:6]) + (" / ..." if len(alphas) > 6 else "") or "-"
            tau = f"{r['tau']:.2f}" if "tau" in r else "-"
            drafted = f"{r['mean_drafted']:.2f}" if r.get("mean_drafted") is not None else "-"
            paused = f"{r['paused']:.0%}" if "paused" in r else "-"
            identical = "-" if r["identical"] is None else f"{r['identical']:.0%}"
            lines.append(f"| {d} | {name} | {r['prompts']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | {tau} | {drafted} | {paused} | "
                         f"{alpha} | {r['memory_normalized_speedup']:.2f} | {r['ttft_s'] * 1000:.0f} | "
                         f"{r['memory_bytes'] / 2**20:.0f} | {identical} |")
    return "\n".join(lines)


def plots(record: dict, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for d, per in record["summary"].items():
        for name, r in per.items():
            alpha = r.get("acceptance_by_depth")
            if alpha:
                ax.plot(range(1, len(alpha) + 1), alpha, marker="o", label=f"{name}, {d}")
    ax.set(xlabel="draft depth k", ylabel="alpha_k (accepted | depth k-1 accepted)", ylim=(0, 1.05),
           title=f"Acceptance by depth, {record['model']}")
    if ax.has_data():
        ax.legend(fontsize=8)
        ax.xaxis.get_major_locator().set_params(integer=True)
    fig.text(0.01, 0.01, record["device"], fontsize=6)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "acceptance.png"), dpi=120)
    plt.close(fig)

    datasets = list(record["summary"])
    names = list(next(iter(record["summary"].values())))
    fig, ax = plt.subplots(figsize=(1.2 + 1.4 * len(names) * len(datasets) / 2, 4))
    width = 0.8 / len(datasets)
    for j, d in enumerate(datasets):
        ax.bar(np.arange(len(names)) + j * width, [record["summary"][d][n]["tokens_per_s"] for n in names], width,
               label=d)
    ax.set_xticks(np.arange(len(names)) + width * (len(datasets) - 1) / 2, names, rotation=20)
    ax.set(ylabel="tokens/s", title=f"Greedy decode speed, {record['model']}")
    ax.legend(fontsize=8)
    fig.text(0.01, 0.01, record["device"], fontsize=6)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "speed.png"), dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    run(main)
