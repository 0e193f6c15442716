"""S3D acceptance on MT-Bench first turns (or HumanEval) with the engine: tau, alpha_k and speed against greedy AR,
for the shipped (or given) draft and the untrained mask token, all in one process.

    python -m benchmarks.s3d_acceptance [--draft FILE ...] [--no-untrained] [--prompts 16] [--max-new-tokens 96] [--tree chain ...]
        [--lookup 0]
"""

from __future__ import annotations

import datetime
import os

import numpy as np

from benchmarks import report
from s3djax.cli import Parser, run

# dataset: (its name in the title, what its prompts are, the report file's suffix)
DATASETS = {"mt-bench": ("MT-Bench", "first turns of MT-Bench questions", ""),
            "humaneval": ("HumanEval", "HumanEval problems", "-humaneval"),
            "sharegpt-heldout": ("held-out ShareGPT", "first turns of held-out ShareGPT conversations", "-sharegpt")}


def main():
    p = Parser(prog="python -m benchmarks.s3d_acceptance", description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", action="append", help="draft file (repeatable; default: the model's shipped draft)")
    p.add_argument("--no-untrained", action="store_true", help="leave out the untrained mask token's runs")
    p.add_argument("--dataset", choices=tuple(DATASETS), default="mt-bench")
    p.add_argument("--prompts", type=int, default=16, help="the first N prompts (MT-Bench: first turns)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--max-cache-len", type=int, default=512)
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--tree", action="append", help="tree shapes to run (repeatable; default chain and tree-16)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--lookup", type=int, help="s3d's switch to prompt lookup (0: never, the draft alone; default: "
                   "the platform's)")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()

    from s3djax.progress import bar

    from s3djax import bench_data, device, methods
    from s3djax.decode import Runner
    from s3djax.loading import load_model
    from s3djax.speculative.loop import acceptance

    m = load_model("smollm2-135m", dtype=args.dtype)
    prompts = [q["ids"] for q in bench_data.prompts(args.dataset, m.tokenizer, args.prompts)]
    build = dict(max_cache_len=args.max_cache_len, dtype=args.dtype, gamma=args.gamma)
    ar = methods.build("ar", m, **build)
    runs = {"ar": Runner(ar.decoder, ar.params)}
    drafts = {}
    for tree in args.tree or ["chain", "tree-16"]:
        paths = {os.path.basename(p): p for p in args.draft} if args.draft else {"trained": None}
        for label, path in {**paths, **({} if args.no_untrained else {"untrained": "none"})}.items():
            built = methods.build("s3d", m, tree=tree, draft_path=path, lookup=args.lookup, **build)
            drafts[label] = built.draft
            runs[f"s3d {label}, {tree}"] = Runner(built.decoder, built.params)
    for runner in runs.values():  # compile outside the timed runs
        runner.generate(prompts[0], 8)
    results = {name: [] for name in runs}
    for ids in bar(prompts, desc=f"{args.dataset} prompts", unit="prompt"):
        for name, runner in runs.items():
            results[name].append(runner.generate(ids, args.max_new_tokens))
    expected = [r.tokens for r in results["ar"]]

    def rate(rs):
        return sum(len(r.tokens) - 1 for r in rs) / sum(r.decode_s for r in rs)

    ar_rate = rate(results["ar"])
    title, what, suffix = DATASETS[args.dataset]
    lines = [f"# S3D acceptance on {title}, SmolLM2-135M-Instruct {args.dtype}", "",
             f"- device: {device.describe()}", f"- date: {datetime.date.today().isoformat()}",
             f"- {what} 1-{len(prompts)}, chat template, greedy, up to "
             f"{args.max_new_tokens} new tokens, cache {args.max_cache_len}, gamma {args.gamma}",
             *[f"- {label}: {about}" for label, about in drafts.items()],
             "- tau: tokens emitted per verify step (bonus included); alpha_k: P(depth k accepted | k-1 was)", "",
             "| method | tokens identical to AR | tau | alpha_1..alpha_gamma | tokens/s | vs AR |",
             "| --- | --- | --- | --- | --- | --- |",
             f"| ar | - | - | - | {ar_rate:.1f} | 1.00x |"]
    for name, rs in results.items():
        if name == "ar":
            continue
        pooled = acceptance(np.concatenate([r.stats["accepted_per_step"] for r in rs]), args.gamma)
        same = sum(r.tokens == e for r, e in zip(rs, expected))
        alpha = " / ".join(f"{a:.2f}" for a in pooled["acceptance_by_depth"])
        lines.append(f"| {name} | {same}/{len(rs)} | {pooled['mean_accepted_tokens']:.2f} | {alpha} | "
                     f"{rate(rs):.1f} | {rate(rs) / ar_rate:.2f}x |")
    report.write(args.out, "s3d_acceptance" + suffix, "\n".join(lines))


if __name__ == "__main__":
    run(main)
