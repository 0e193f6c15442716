"""Latency of the speculative building blocks on SmolLM2, in one process: AR step, S3D draft step,
and the verify step for each tree size (how verification cost grows with the tree).

    python -m benchmarks.research.spec_step_latency [--max-cache-len 1024] [--context 256] [--repeats 20]
"""

from __future__ import annotations

import datetime

from benchmarks import report
from s3djax.cli import Parser, run


def main():
    p = Parser(prog="python -m benchmarks.research.spec_step_latency", description=__doc__.splitlines()[0])
    p.add_argument("--max-cache-len", type=int, default=1024)
    p.add_argument("--context", type=int, default=256, help="committed tokens in the cache")
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()


    from s3djax import device, methods
    from s3djax.decode import Runner
    from s3djax.loading import load_model
    from s3djax.speculative import tree as trees
    from s3djax.speculative.profile import step_times

    m = load_model("smollm2-135m", dtype=args.dtype)
    built = methods.build("s3d", m, max_cache_len=args.max_cache_len, dtype=args.dtype, gamma=args.gamma)
    decoder = built.decoder
    # A real state: the prompt is `context` tokens of committed cache.
    prompt = [(7 * i) % 1000 + 100 for i in range(args.context)]
    state = Runner(decoder, built.params).prefill(prompt)
    named = {"chain": trees.TreeSpec.chain(args.gamma), **{n: trees.resolve(n, args.gamma) for n in trees.named_trees()}}
    ms = step_times(decoder, built.params, state, trees=named, repeats=args.repeats)
    plan = decoder.drafter.plan
    rows = [("AR step", 1, ms["ar_step_ms"]),
            (f"S3D draft step, gamma {args.gamma}, skip {plan.spec()}", args.gamma, ms["draft_step_ms"])]
    rows += [(f"verify, tree {name}", tree.num_nodes, ms[f"verify_{name}_ms"]) for name, tree in named.items()]
    ar = rows[0][2]
    dev = device.describe()
    lines = [f"# Speculative step latencies, SmolLM2-135M-Instruct {args.dtype}", "",
             f"- device: {dev}", f"- date: {datetime.date.today().isoformat()}",
             f"- cache length {args.max_cache_len}, {args.context} committed tokens; each step run {args.repeats} times "
             "in a fori_loop carrying the cache, median of 3 such runs", "",
             "| step | tokens in | ms | vs AR step |", "| --- | --- | --- | --- |"]
    lines += [f"| {name} | {n} | {ms:.1f} | {ms / ar:.2f}x |" for name, n, ms in rows]
    table = "\n".join(lines)
    report.write(args.out, "spec_step_latency", table)

if __name__ == "__main__":
    run(main)
