"""Record what each chain depth commits, per method, on held-out prompts: the acceptance half of the speed model.

    python -m train.acceptance [--model smollm2-135m] [--methods s3d,lookup] [--depths 1-8] [--limit 24]

For every method and chain depth g, greedy and sampled (temperature 0.7, top-p 0.9), the method decodes the first
`--limit` held-out ShareGPT first turns at depth g with its other options at their defaults but the pause gate (off:
a paused step is the machine's choice, and a record is what drafts commit where they run), and the file records
tau (tokens committed per step) and the share of steps whose model draft ran (a chain that gives way to prompt
lookup skips it). These do not depend on the machine: greedy output is the target's, and which source drafts depends
on the tokens alone. `s3djax.defaults` pairs them with step times measured on the user's machine to choose the depth.

The file is rewritten after every finished depth, and a rerun skips what it holds for the same artifact and prompts.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import sys

from s3djax.cli import Parser, run

from s3djax.speed_model import DEPTH_OPTION

METHODS = tuple(DEPTH_OPTION)  # every method whose chain depth the speed model chooses
SAMPLED = dict(temperature=0.7, top_p=0.9)  # the usual chat settings, as the file records them


def depth_list(text: str) -> list[int] | None:
    lo, _, hi = text.partition("-")
    try:
        return list(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        return None


def artifact(path: str | None) -> dict:
    """How a record names the method's shipped artifact: its path and a hash of its contents."""
    if path is None:
        return {"artifact": None, "sha256": None}
    from s3djax.registry import CONFIG_DIR

    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    return {"artifact": os.path.relpath(path, CONFIG_DIR), "sha256": digest}


def main():
    p = Parser(prog="python -m train.acceptance", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="a registry name (its shipped artifacts are recorded)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, from {', '.join(METHODS)}")
    p.add_argument("--depths", default="1-8", type=depth_list, help="chain depths, e.g. 1-8")
    p.add_argument("--limit", type=int, default=24, help="held-out ShareGPT prompts")
    p.add_argument("--max-prompt", type=int, default=1024, help="longer prompts are left out")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", help="default: configs/acceptance/MODEL.json")
    args = p.parse_args()
    args.methods = [m for m in args.methods.split(",") if m]
    p.check(args, methods=bool(args.methods) and set(args.methods) <= set(METHODS), depths=bool(args.depths),
            limit=args.limit >= 1, max_new_tokens=args.max_new_tokens >= 2)

    from s3djax import bench_data, defaults, methods, registry
    from s3djax.built import lookup_switch
    from s3djax.generator import Generator
    from s3djax.options import Options
    from s3djax.sampling import Sampling
    from s3djax.speculative.loop import acceptance

    entry = registry.lookup(args.model)
    out = args.out or defaults.acceptance_path(args.model)
    gen = Generator(args.model, max_cache_len=args.max_prompt + args.max_new_tokens + 64)
    prompts = [p for p in bench_data.prompts("sharegpt-heldout", gen.tokenizer, None)
               if len(p["ids"]) <= args.max_prompt][:args.limit]
    about_prompts = {"dataset": "sharegpt-heldout", "prompts": len(prompts), "max_new_tokens": args.max_new_tokens}
    table = defaults.read_acceptance(out) if os.path.exists(out) else {}
    for method in args.methods:
        switch = lookup_switch(Options(), method) if method in methods.GIVES_WAY else 0
        record = {**artifact(entry.draft_path(method)), "lookup_switch": switch, "prompts": about_prompts}
        if {k: table.get(method, {}).get(k) for k in record} != record:
            table[method] = dict(record)
        for name, sampling in (("greedy", Sampling()), ("sampled", Sampling(**SAMPLED))):
            rows = table[method].setdefault(name, {})
            for g in args.depths:
                if str(g) in rows:
                    continue
                steps, lookup_steps = [], 0
                for i, prompt in enumerate(prompts):
                    out_i = gen.generate(prompt["text"], args.max_new_tokens, method=method, seed=i, sampling=sampling,
                                         pause="off", **defaults.depth_options(method, g))
                    steps += out_i.stats["accepted_per_step"]
                    lookup_steps += out_i.stats.get("lookup_steps", 0 if method != "lookup" else
                                                    out_i.stats["verify_steps"])
                stats = acceptance(steps, g)
                rows[str(g)] = {"tau": round(stats["mean_accepted_tokens"], 4),
                                "model_drafts": round(1 - lookup_steps / max(len(steps), 1), 4), "steps": len(steps)}
                table[method].update(sampled_at=SAMPLED, date=datetime.date.today().isoformat())
                defaults.write_acceptance(out, table)
                print(f"{method} {name} depth {g}: tau {rows[str(g)]['tau']:.2f}, model drafts "
                      f"{rows[str(g)]['model_drafts']:.0%} of {len(steps)} steps", file=sys.stderr, flush=True)
    print(out)


if __name__ == "__main__":
    run(main)
