"""Two implementations timed against each other in one run: decode tokens/s and compile time.

    python -m benchmarks.ab_commits --before 10ecff4 --after HEAD --rounds 3 --out benchmarks/results/ab.md
    python -m benchmarks.ab_commits --before X --after Y --methods ar,s3d,lookup --dataset mt-bench,humaneval \
        --limit mt-bench=20,humaneval=10 --rounds 2 --out F.md

Each revision is checked out into a temporary git worktree and runs `infer.benchmark` (default flags but
`--flags`) in its own process; the two alternate round by round, so drift on a shared machine falls on
both alike. Reported per dataset: the median over rounds of each method's pooled tokens/s and of its compile time
(the first prompt's, which is where every executable is built), and, greedy, how many of its outputs are the
same in both revisions.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile

from s3djax.cli import Parser, run
from s3djax.errors import UserError


def worktree(rev: str, root: str) -> str:
    path = tempfile.mkdtemp(prefix=f"ab-{rev[:12]}-")
    done = subprocess.run(["git", "-C", root, "worktree", "add", "--detach", "-f", path, rev], capture_output=True, text=True)
    if done.returncode:
        raise UserError(f"cannot check out {rev}: {done.stderr.strip().splitlines()[-1]}")
    # Its own native kernels (git ignores the build), so each side decodes as a user's checkout of it would.
    if os.path.exists(os.path.join(path, "cpu_kernels", "build.py")):
        subprocess.run([sys.executable, "-m", "cpu_kernels.build"], cwd=path, env={**os.environ, "PYTHONPATH": path},
                       capture_output=True)
    return path


def one_run(tree: str, args, out: str) -> dict:
    cmd = [sys.executable, "-m", "infer.benchmark", "--methods", args.methods, "--dataset", args.dataset,
           "--limit", args.limit, "--max-new-tokens", str(args.max_new_tokens), "--out", out,
           *shlex.split(args.flags)]
    done = subprocess.run(cmd, cwd=tree, env={**os.environ, "PYTHONPATH": tree}, capture_output=True, text=True)
    if done.returncode:  # a bad --flags value, or a revision that fails: the benchmark's own last line
        raise UserError(f"infer.benchmark failed in {tree}: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    with open(os.path.join(out, "results.json")) as f:
        results = json.load(f)
    return {d: {m: {"tokens_per_s": s["tokens_per_s"],
                    "compile_s": sum(r["compile_s"] for r in results["runs"][d][m]),
                    "tokens": [r["tokens"] for r in results["runs"][d][m]], "identical": s.get("identical")} for m, s in summary.items()}
            for d, summary in results["summary"].items()}


def change(before: float, after: float) -> str:
    return f"{after / before - 1:+.1%}" if before else "-"  # a later dataset compiles nothing: 0 s


def main(argv=None):
    p = Parser(prog="python -m benchmarks.ab_commits", description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True)
    p.add_argument("--after", required=True)
    p.add_argument("--methods", default="ar,s3d")
    p.add_argument("--dataset", default="mt-bench", help="comma-separated, as infer.benchmark's")
    p.add_argument("--limit", default="5", help="prompts per dataset, as infer.benchmark's")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--flags", default="", help='more infer.benchmark flags for both, e.g. "--temperature 1 --top-p 0.95"')
    p.add_argument("--out", required=True, help="a markdown file for the table")
    args = p.parse_args(argv)
    from s3djax import device

    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True).stdout.strip()
    trees = {label: worktree(rev, root) for label, rev in (("before", args.before), ("after", args.after))}
    found: dict = {label: [] for label in trees}
    try:
        for r in range(args.rounds):
            for label, tree in trees.items():
                with tempfile.TemporaryDirectory() as out:
                    found[label].append(one_run(tree, args, out))
                rates = {d: {m: round(x["tokens_per_s"], 1) for m, x in per.items()} for d, per in found[label][-1].items()}
                print(f"round {r + 1}/{args.rounds} {label}: {rates}", file=sys.stderr, flush=True)
    finally:
        for tree in trees.values():
            subprocess.run(["git", "-C", root, "worktree", "remove", "--force", tree], capture_output=True)
    median = lambda label, d, m, key: statistics.median(x[d][m][key] for x in found[label])  # noqa: E731
    # A sampled run records no share identical to ar (outputs differ by design), whatever its flags say it did.
    greedy = all(v["identical"] is not None for x in found["before"] + found["after"] for per in x.values()
                 for v in per.values())
    lines = [f"# {args.before} (before) against {args.after} (after)", "",
             f"{device.describe()}; `infer.benchmark --methods {args.methods} --dataset {args.dataset} --limit "
             f"{args.limit} --max-new-tokens {args.max_new_tokens}{' ' + args.flags if args.flags else ''}`, "
             f"{'otherwise ' if args.flags else ''}default flags; median of {args.rounds} "
             "alternating rounds, each revision in its own process"
             + ("; same output: a method's outputs equal in both revisions, every round; identical to ar: its outputs "
                "equal to `ar`'s in the same run, the fewest of any round, before / after." if greedy else "."), "",
             "| dataset | method | tokens/s before | tokens/s after | change | compile s before | compile s after | change "
             + ("| same output | identical to ar |" if greedy else "|"), "| --- " * (8 + 2 * greedy) + "|"]
    for d, per in found["before"][0].items():
        for m in per:
            tb, ta = median("before", d, m, "tokens_per_s"), median("after", d, m, "tokens_per_s")
            cb, ca = median("before", d, m, "compile_s"), median("after", d, m, "compile_s")
            same = ""
            if greedy:
                pairs = [(b, a) for x, y in zip(found["before"], found["after"])
                         for b, a in zip(x[d][m]["tokens"], y[d][m]["tokens"])]
                identical = " / ".join(f"{min(x[d][m]['identical'] for x in found[label]):.0%}" for label in found)
                same = f" {sum(b == a for b, a in pairs)}/{len(pairs)} | {identical} |"
            lines.append(f"| {d} | {m} | {tb:.1f} | {ta:.1f} | {change(tb, ta)} | {cb:.1f} | {ca:.1f} | "
                         f"{change(cb, ca)} |{same}")
    for rounds in found.values():
        for x in rounds:
            for per in x.values():
                for v in per.values():
                    del v["tokens"]  # the raw rounds keep the figures, not every output
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n\nRaw rounds:\n\n```\n" + json.dumps(found, indent=1) + "\n```\n")
    print("\n".join(lines))


if __name__ == "__main__":
    run(main)
