"""A training run's record for benchmarks/results/: settings, throughput and the held-out curve.

    python -m train.report RUN_DIR NAME   # writes NAME.md and copies loss.png, metrics.jsonl
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import numpy as np

from s3djax.cli import Parser, run
from s3djax.errors import UserError


def main():
    p = Parser(prog="python -m train.report", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir")
    p.add_argument("name")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    paths = {n: os.path.join(args.run_dir, n) for n in ("config.json", "metrics.jsonl", "loss.png", "draft.npz")}
    missing = [n for n, path in paths.items() if not os.path.isfile(path)]
    if missing:
        raise UserError(f"{args.run_dir} is not a finished training run (missing {', '.join(missing)})")
    with open(paths["config.json"]) as f:
        cfg = json.load(f)
    with open(paths["metrics.jsonl"]) as f:
        records = [json.loads(line) for line in f if line.strip()]
    with np.load(paths["draft.npz"]) as d:
        meta = json.loads(bytes(d["__meta__"]).decode())
    train = [r for r in records if r["split"] == "train"]
    evals = [r for r in records if r["split"] == "eval"]
    rate = np.median([r["tokens_per_s"] for r in train[1:]] or [0])
    lines = [f"# Training run {args.name}", "",
             f"- device: {meta['trained_on']}",
             f"- settings: {', '.join(f'{k}={v}' for k, v in cfg.items() if k not in ('out', 'data'))}",
             f"- data: {cfg['data']} ({train[-1]['epoch']:.3f} epochs seen)",
             f"- throughput: median {rate:.0f} context tokens/s over training steps",
             "- held-out: the same anchors at every evaluation; accuracy = the draft's top-1 equals the full "
             "model's greedy token, teacher-forced on ShareGPT text (an acceptance proxy)", "",
             "| step | held-out block loss | accuracy depth 1..gamma |", "| --- | --- | --- |"]
    lines += [f"| {r['step']} | {r['loss']:.3f} | {' / '.join(f'{a:.3f}' for a in r['depth_acc'])} |" for r in evals]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.name}.md"), "w") as f:
        f.write("\n".join(lines) + f"\n\n![loss]({args.name}-loss.png)\n")
    shutil.copy(paths["loss.png"], os.path.join(args.out, f"{args.name}-loss.png"))
    shutil.copy(paths["metrics.jsonl"], os.path.join(args.out, f"{args.name}-metrics.jsonl"))
    print("\n".join(lines))
    print(f"wrote {args.out}/{args.name}.md", file=sys.stderr)


if __name__ == "__main__":
    run(main)
