"""Two implementations timed against each other in one run: decode tokens/s and compile time.

    python -m benchmarks.ab_commits --before 10ecff4 --after HEAD --rounds 3 --out benchmarks/results/ab.md

Each revision is checked out into a temporary git worktree and runs `infer.benchmark` (default flags but
`--flags`, MT-Bench) in its own process; the two alternate round by round, so drift on a shared machine falls on
both alike. Reported: the median over rounds of each method's pooled tokens/s and of its compile time
(the first prompt's, which is where every executable is built).
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
           "--limit", str(args.limit), "--max-new-tokens", str(args.max_new_tokens), "--out", out,
           *shlex.split(args.flags)]
    done = subprocess.run(cmd, cwd=tree, env={**os.environ, "PYTHONPATH": tree}, capture_output=True, text=True)
    if done.returncode:  # a bad --flags value, or a revision that fails: the benchmark's own last line
        raise UserError(f"infer.benchmark failed in {tree}: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    with open(os.path.join(out, "results.json")) as f:
        results = json.load(f)
    summary = results["summary"][args.dataset]
    return {m: {"tokens_per_s": summary[m]["tokens_per_s"],
                "compile_s": sum(r["compile_s"] for r in results["runs"][args.dataset][m])} for m in summary}


def main(argv=None):
    p = Parser(prog="python -m benchmarks.ab_commits", description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True)
    p.add_argument("--after", required=True)
    p.add_argument("--methods", default="ar,s3d")
    p.add_argument("--dataset", default="mt-bench")
    p.add_argument("--limit", type=int, default=5)
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
                print(f"round {r + 1}/{args.rounds} {label}: {found[label][-1]}", file=sys.stderr, flush=True)
    finally:
        for tree in trees.values():
            subprocess.run(["git", "-C", root, "worktree", "remove", "--force", tree], capture_output=True)
    median = lambda label, m, key: statistics.median(x[m][key] for x in found[label])
    lines = [f"# {args.before} (before) against {args.after} (after)", "",
             f"{device.describe()}; `infer.benchmark --methods {args.methods} --dataset {args.dataset} --limit "
             f"{args.limit} --max-new-tokens {args.max_new_tokens}{' ' + args.flags if args.flags else ''}`, "
             f"{'otherwise ' if args.flags else ''}default flags; median of {args.rounds} "
             "alternating rounds, each revision in its own process.", "",
             "| method | tokens/s before | tokens/s after | change | compile s before | compile s after | change |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for m in found["before"][0]:
        tb, ta = median("before", m, "tokens_per_s"), median("after", m, "tokens_per_s")
        cb, ca = median("before", m, "compile_s"), median("after", m, "compile_s")
        lines.append(f"| {m} | {tb:.1f} | {ta:.1f} | {ta / tb - 1:+.1%} | {cb:.1f} | {ca:.1f} | {ca / cb - 1:+.1%} |")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n\nRaw rounds:\n\n```\n" + json.dumps(found, indent=1) + "\n```\n")
    print("\n".join(lines))


if __name__ == "__main__":
    run(main)
