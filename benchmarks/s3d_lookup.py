"""S3D giving way to prompt lookup: `ar` and s3d at each --lookup switch, interleaved prompt by prompt in one
process, so that a shared machine's drift falls on every variant alike.

    python -m benchmarks.s3d_lookup --lookup 0,1,2,3 --dataset mt-bench,humaneval --limit mt-bench=12,humaneval=6
"""

from __future__ import annotations

import datetime

from benchmarks import report
from s3djax.cli import Parser, run


def main():
    from infer.benchmark import parse_limits

    p = Parser(prog="python -m benchmarks.s3d_lookup", description=__doc__.splitlines()[0])
    p.add_argument("--lookup", default="0,1,2,3", help="comma-separated switches (0: s3d alone)")
    p.add_argument("--gamma", type=int, default=None)
    p.add_argument("--dataset", default="mt-bench,humaneval", help="comma-separated: mt-bench, humaneval")
    p.add_argument("--limit", default="mt-bench=12,humaneval=6", help="prompts per dataset, as infer.benchmark's")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2, help="passes over the prompts")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    datasets = [d for d in args.dataset.split(",") if d]
    limits = parse_limits(args.limit, datasets)
    p.check(args, lookup=all(s.strip().isdigit() for s in args.lookup.split(",")), limit=limits is not None,
            rounds=args.rounds >= 1, max_new_tokens=args.max_new_tokens >= 2)

    from infer.benchmark import pooled_tokens_per_s
    from s3djax import device, methods
    from s3djax.bench_data import prompts
    from s3djax.decode import Runner
    from s3djax.loading import load_model
    from s3djax.speculative.loop import acceptance

    m = load_model("smollm2-135m", progress=False)
    sets = {name: [q["ids"] for q in prompts(name, m.tokenizer, limits.get(name))] for name in datasets}
    variants = {"ar": methods.build("ar", m, max_cache_len=2048)}
    variants |= {f"s3d, lookup {k}": methods.build("s3d", m, max_cache_len=2048, gamma=args.gamma, lookup=k)
                 for k in map(int, args.lookup.split(","))}
    runners = {name: Runner(b.decoder, b.params) for name, b in variants.items()}
    for r in runners.values():
        r.generate(next(iter(sets.values()))[0], 4)  # compile outside the timing
    runs = {(s, v): [] for s in sets for v in runners}
    for _ in range(args.rounds):
        for s, ids_list in sets.items():
            for ids in ids_list:
                for v, r in runners.items():
                    runs[s, v].append(r.generate(ids, args.max_new_tokens))
    gamma = args.gamma or methods.default_gamma(None)
    lines = ["# S3D giving way to prompt lookup, SmolLM2-135M-Instruct float32", "",
             f"- device: {device.describe()}", f"- date: {datetime.date.today().isoformat()}",
             f"- {args.max_new_tokens} new tokens, greedy; gamma {gamma}, chain; {args.rounds} rounds, the variants "
             "interleaved prompt by prompt; tokens/s: tokens after the first over decode time, pooled; tau: tokens "
             "per verify step", "",
             "| set | variant | tokens/s | vs ar | tau | identical to ar |", "| --- | --- | --- | --- | --- | --- |"]
    for s, ids_list in sets.items():
        tps = {v: pooled_tokens_per_s([{"tokens": r.tokens, "decode_s": r.decode_s} for r in runs[s, v]])
               for v in runners}
        for v in runners:
            accepted = [a for r in runs[s, v] for a in r.stats.get("accepted_per_step", ())]
            tau = f"{acceptance(accepted, gamma)['mean_accepted_tokens']:.2f}" if accepted else "-"
            same = sum(r.tokens == b.tokens for r, b in zip(runs[s, v], runs[s, "ar"]))
            lines.append(f"| {s} {len(ids_list)} | {v} | {tps[v]:.1f} | {tps[v] / tps['ar']:.2f}x | {tau} | "
                         f"{same}/{len(runs[s, v])} |")
    report.write(args.out, "s3d_lookup", "\n".join(lines))


if __name__ == "__main__":
    run(main)
