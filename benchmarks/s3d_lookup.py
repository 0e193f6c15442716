"""S3D giving way to prompt lookup: `ar` and s3d at each --lookup switch, interleaved prompt by prompt in one
process, so that a shared machine's drift falls on every variant alike.

    python -m benchmarks.s3d_lookup --lookup 0,1,2,3 --limit mt-bench=12,humaneval=6 --rounds 2
"""

from __future__ import annotations

import datetime

from benchmarks import report
from s3djax.cli import Parser, run


def main():
    p = Parser(prog="python -m benchmarks.s3d_lookup", description=__doc__.splitlines()[0])
    p.add_argument("--lookup", default="0,1,2,3", help="comma-separated switches (0: s3d alone)")
    p.add_argument("--gamma", type=int, default=None)
    p.add_argument("--limit", default="mt-bench=12,humaneval=6", help="prompts per set: SET=N,...")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2, help="passes over the prompts (the first also checks identity)")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    switches = [int(s) for s in args.lookup.split(",") if s.strip().isdigit()]
    limits = dict(item.partition("=")[::2] for item in args.limit.split(","))
    if not switches or len(switches) != len(args.lookup.split(",")):
        p.error(f"--lookup: invalid value {args.lookup!r}")
    if not all(n.isdigit() for n in limits.values()):
        p.error(f"--limit: invalid value {args.limit!r}")

    from s3djax import device, methods
    from s3djax.bench_data import prompts
    from s3djax.decode import Runner
    from s3djax.loading import load_model

    m = load_model("smollm2-135m", progress=False)
    sets = {name: [q["ids"] for q in prompts(name, m.tokenizer, int(n))] for name, n in limits.items()}
    variants = {"ar": methods.build("ar", m, max_cache_len=2048)}
    variants |= {f"s3d, lookup {k}": methods.build("s3d", m, max_cache_len=2048, gamma=args.gamma, lookup=k)
                 for k in switches}
    runners = {name: Runner(b.decoder, b.params) for name, b in variants.items()}
    for r in runners.values():
        r.generate(next(iter(sets.values()))[0], 4)  # compile outside the timing
    decoded, seconds, steps, committed, same = ({(s, v): 0 for s in sets for v in runners} for _ in range(5))
    for rnd in range(args.rounds):
        for s, ids_list in sets.items():
            for ids in ids_list:
                expected = None
                for v, r in runners.items():
                    res = r.generate(ids, args.max_new_tokens)
                    decoded[s, v] += len(res.tokens) - 1
                    seconds[s, v] += res.decode_s
                    if v != "ar":
                        steps[s, v] += res.stats["verify_steps"]
                        committed[s, v] += res.stats["mean_accepted_tokens"] * res.stats["verify_steps"]
                    expected = res.tokens if expected is None else expected
                    same[s, v] += rnd == 0 and res.tokens == expected
    lines = ["# S3D giving way to prompt lookup, SmolLM2-135M-Instruct float32", "",
             f"- device: {device.describe()}", f"- date: {datetime.date.today().isoformat()}",
             f"- {args.max_new_tokens} new tokens, greedy; gamma {args.gamma or methods.default_gamma(None)}, chain; {args.rounds} rounds, the variants interleaved "
             "prompt by prompt; tokens/s: tokens after the first over decode time, pooled; tau: tokens per verify step",
             "", "| set | variant | tokens/s | vs ar | tau | identical to ar |", "| --- | --- | --- | --- | --- | --- |"]
    for s, ids_list in sets.items():
        base = decoded[s, "ar"] / seconds[s, "ar"]
        for v in runners:
            tps = decoded[s, v] / seconds[s, v]
            tau = "-" if v == "ar" else f"{committed[s, v] / steps[s, v]:.2f}"
            lines.append(f"| {s} {len(ids_list)} | {v} | {tps:.1f} | {tps / base:.2f}x | {tau} | "
                         f"{same[s, v]}/{len(ids_list)} |")
    report.write(args.out, "s3d_lookup", "\n".join(lines))


if __name__ == "__main__":
    run(main)
