"""A drafter's settings against `ar`: every draft file x gamma x max draft x tree x --lookup switch x draft weights
given, interleaved prompt by prompt in one process, so that a shared machine's drift falls on every variant alike.

    python -m benchmarks.s3d_lookup --lookup 0,1,2,3 --dataset mt-bench,humaneval --limit mt-bench=12,humaneval=6
    python -m benchmarks.s3d_lookup --draft shipped,runs/x/draft.npz --gamma 2,4 --lookup 0,1
    python -m benchmarks.s3d_lookup --draft-weights none,int8 --gamma 2,3,4 --lookup 1
    python -m benchmarks.s3d_lookup --method kangaroo --tree top2,chain --max-draft 1,2 --lookup 0,1
    python -m benchmarks.s3d_lookup --method lookup --max-draft 2,3,4
"""

from __future__ import annotations

import datetime
import itertools
import sys

from benchmarks import report
from s3djax.cli import Parser, run

AXES = {"draft_path": "draft", "gamma": "gamma", "max_draft": "max draft", "tree": "tree", "lookup": "lookup",
        "draft_weights": "weights", "in_verify": "in verify"}


def main():
    from infer.benchmark import parse_limits

    p = Parser(prog="python -m benchmarks.s3d_lookup", description=__doc__.splitlines()[0])
    p.add_argument("--method", default="s3d", choices=("s3d", "self-spec", "kangaroo", "s2d", "lookup"))
    p.add_argument("--lookup", default="0,1,2,3", help="comma-separated switches (0: the drafter alone; "
                   "--method lookup has none, and ignores it)")
    p.add_argument("--gamma", default="", help="s3d: comma-separated depths, `default` for the one chosen on this "
                   "machine (default: that alone)")
    p.add_argument("--max-draft", default="", help="self-spec, kangaroo, s2d, lookup: comma-separated "
                   "depths, `default` for the method's (default: that alone)")
    p.add_argument("--tree", default="", help="comma-separated trees (default: the method's)")
    p.add_argument("--draft", default="shipped", help="comma-separated draft files (shipped: the model's own)")
    p.add_argument("--draft-weights", default="", help="comma-separated: none, int8 (default: the platform's)")
    p.add_argument("--in-verify", default="", help="s3d: comma-separated on, off (default: the platform's)")
    p.add_argument("--dataset", default="mt-bench,humaneval", help="comma-separated: mt-bench, humaneval")
    p.add_argument("--limit", default="mt-bench=12,humaneval=6", help="prompts per dataset, as infer.benchmark's")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2, help="passes over the prompts")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    datasets = [d for d in args.dataset.split(",") if d]
    limits = parse_limits(args.limit, datasets)
    numbers = lambda text: all(s.strip().isdigit() or s == "default" for s in text.split(","))  # noqa: E731
    p.check(args, lookup=numbers(args.lookup), gamma=not args.gamma or numbers(args.gamma),
            max_draft=not args.max_draft or numbers(args.max_draft), limit=limits is not None, rounds=args.rounds >= 1,
            max_new_tokens=args.max_new_tokens >= 2)

    from infer.benchmark import pooled_tokens_per_s
    from s3djax import device, methods
    from s3djax.bench_data import prompts
    from s3djax.decode import Runner
    from s3djax.errors import UserError
    from s3djax.loading import load_model
    from s3djax.speculative.loop import acceptance

    m = load_model("smollm2-135m", progress=False)
    sets = {name: [q["ids"] for q in prompts(name, m.tokenizer, limits.get(name))] for name in datasets}
    listed = lambda text, kind=str: [None if v == "default" else kind(v)  # noqa: E731
                                     for v in text.split(",")] if text else [None]
    axes = {"draft_path": [None if d == "shipped" else d for d in args.draft.split(",")],
            "gamma": listed(args.gamma, int), "max_draft": listed(args.max_draft, int), "tree": listed(args.tree),
            "lookup": [None] if args.method == "lookup" else listed(args.lookup, int),  # lookup has no switch
            "draft_weights": listed(args.draft_weights), "in_verify": listed(args.in_verify)}
    variants, depth = {"ar": methods.build("ar", m, max_cache_len=2048)}, {}
    for combo in itertools.product(*axes.values()):
        opts = dict(zip(axes, combo))
        name = ", ".join(f"{AXES[k]} {'default' if v is None else v}" for k, v in opts.items() if len(axes[k]) > 1)
        name = f"{args.method}, {name}" if name else args.method
        try:
            variants[name] = methods.build(args.method, m, max_cache_len=2048, **opts)
        except UserError as e:  # lookup on a tree, say: the other combinations still run
            print(f"skipped {name}: {e}", file=sys.stderr)
            continue
        depth[name] = variants[name].decoder.drafter.tree.depth
    runners = {name: Runner(b.decoder, b.params) for name, b in variants.items()}
    for r in runners.values():
        r.generate(next(iter(sets.values()))[0], 4)  # compile outside the timing
    runs = {(s, v): [] for s in sets for v in runners}
    for _ in range(args.rounds):
        for s, ids_list in sets.items():
            for ids in ids_list:
                for v, r in runners.items():
                    runs[s, v].append(r.generate(ids, args.max_new_tokens))
    lines = [f"# {args.method}'s settings against ar, SmolLM2-135M-Instruct float32", "",
             f"- device: {device.describe()}", f"- date: {datetime.date.today().isoformat()}",
             *[f"- {name}: {b.draft}" for name, b in variants.items() if b.draft],
             f"- {args.max_new_tokens} new tokens, greedy; {args.rounds} rounds, the variants "
             "interleaved prompt by prompt; tokens/s: tokens after the first over decode time, pooled; tau: tokens "
             "per verify step", "",
             "| set | variant | tokens/s | vs ar | tau | alpha by depth | identical to ar |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for s, ids_list in sets.items():
        tps = {v: pooled_tokens_per_s([{"tokens": r.tokens, "decode_s": r.decode_s} for r in runs[s, v]])
               for v in runners}
        for v in runners:
            accepted = [a for r in runs[s, v] for a in r.stats.get("accepted_per_step", ())]
            got = acceptance(accepted, depth[v]) if accepted else None
            tau = f"{got['mean_accepted_tokens']:.2f}" if got else "-"
            alpha = " / ".join(f"{a:.2f}" for a in got["acceptance_by_depth"]) if got else "-"
            same = sum(r.tokens == b.tokens for r, b in zip(runs[s, v], runs[s, "ar"]))
            lines.append(f"| {s} {len(ids_list)} | {v} | {tps[v]:.1f} | {tps[v] / tps['ar']:.2f}x | {tau} | "
                         f"{alpha} | {same}/{len(runs[s, v])} |")
    report.write(args.out, f"{args.method}_lookup".replace("-", "_"), "\n".join(lines))


if __name__ == "__main__":
    run(main)
