"""Latency of the speculative building blocks on SmolLM2, in one process: AR step, S3D draft step,
and the verify step for each tree size (how verification cost grows with the tree).

    python -m benchmarks.spec_step_latency [--cache-len 1024] [--context 256] [--repeats 20]
"""

from __future__ import annotations

import datetime
import os
import statistics
import sys
import time

from infer.cli import Parser, run


def main():
    p = Parser(prog="python -m benchmarks.spec_step_latency", description=__doc__.splitlines()[0])
    p.add_argument("--cache-len", type=int, default=1024)
    p.add_argument("--context", type=int, default=256, help="committed tokens in the cache")
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()

    import jax
    import jax.numpy as jnp

    from s3djax import cache as kv
    from s3djax import device
    from s3djax.loading import load_model
    from s3djax.methods import default_draft_plan
    from s3djax.spec import tree as trees
    from s3djax.spec.draft_params import init_draft
    from s3djax.spec.drafters.s3d import S3DDrafter
    from s3djax.spec.loop import ROOT_ONLY
    from s3djax.spec.verify import verify

    m = load_model("smollm2-135m", dtype=args.dtype)
    config, params = m.config, m.params
    plan = default_draft_plan(config.num_layers)
    draft = init_draft(params, config, plan)
    cache = kv.init_cache(config, 1, args.cache_len, jnp.dtype(args.dtype))
    length = jnp.asarray([args.context], jnp.int32)
    last = jnp.asarray([42], jnp.int32)

    def timed(fn, *a):
        fn = jax.jit(fn)
        jax.block_until_ready(fn(*a))
        samples = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            jax.block_until_ready(fn(*a))
            samples.append(time.perf_counter() - t)
        return statistics.median(samples) * 1000

    def verify_ms(tree):
        n = tree.num_nodes - 1
        nodes, valid = jnp.zeros((1, n), jnp.int32), jnp.ones((1, n), bool)
        # The emitted tokens depend on the whole forward, so nothing is optimised away.
        return timed(lambda c: verify(params, c, length, last, nodes, valid, config=config, tree=tree)[2], cache)

    chain = trees.TreeSpec.chain(args.gamma)
    drafter = S3DDrafter(config, plan, chain, args.gamma)
    rows = [("AR step (verify of the root alone)", 1, verify_ms(ROOT_ONLY)),
            (f"S3D draft step, gamma {args.gamma}, skip {plan.spec()}", args.gamma,
             timed(lambda c: drafter.draft(params, draft, c, length, last, ())[0], cache))]
    named = {"chain": chain, **{n: trees.resolve(n, args.gamma) for n in trees.named_trees()}}
    for name, tree in named.items():
        rows.append((f"verify, tree {name}", tree.num_nodes, verify_ms(tree)))
        print(rows[-1], file=sys.stderr)
    ar = rows[0][2]
    dev = device.describe()
    lines = [f"# Speculative step latencies, SmolLM2-135M-Instruct {args.dtype}", "",
             f"- device: {dev}", f"- date: {datetime.date.today().isoformat()}",
             f"- cache length {args.cache_len}, {args.context} committed tokens; median of {args.repeats}", "",
             "| step | tokens in | ms | vs AR step |", "| --- | --- | --- | --- |"]
    lines += [f"| {name} | {n} | {ms:.1f} | {ms / ar:.2f}x |" for name, n, ms in rows]
    table = "\n".join(lines)
    print(table)
    os.makedirs(args.out, exist_ok=True)
    slug = "cpu" if jax.devices()[0].platform == "cpu" else jax.devices()[0].device_kind.replace(" ", "-").lower()
    path = os.path.join(args.out, f"spec_step_latency-{slug}.md")
    with open(path, "w") as f:
        f.write(table + "\n")
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    run(main)
