"""What T query rows of attention cost against one on the CPU: SmolLM2's 30 layers of decode-time attention (9
query / 3 KV heads of 64, a causal tree over the T new rows) at a committed context, through the native kernel
(`cpu_kernels.attention`) and XLA's blocked prefix attention, both as the model calls them (`layers.attend`), each
against its own T = 1, one process. A verify
step pays this beside its matmuls; on a memory-bound device the rows of one step share the reads of the cache.

    python -m benchmarks.research.cpu_attention [--repeats 30] [--contexts 256,1024,4096]

Each layer has its own K/V cache of 2x the longest context (fp32), as the model's decode steps do, so the
layers' caches do not stay in the core's caches between calls.
"""

from __future__ import annotations

import datetime

from benchmarks import report
from s3djax.cli import Parser, run

HEADS, KV_HEADS, HEAD, LAYERS = 9, 3, 64, 30
ROWS = (1, 2, 3, 5, 9, 17)


def main():
    p = Parser(prog="python -m benchmarks.research.cpu_attention", description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--contexts", default="256,1024,4096", help="committed keys, comma-separated")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    contexts = [int(c) for c in args.contexts.split(",") if c.strip().isdigit()]
    p.check(args, repeats=args.repeats >= 1, contexts=bool(contexts) and min(contexts) >= 1)

    import jax
    import jax.numpy as jnp

    from cpu_kernels import matmul
    from s3djax import device, layers
    from s3djax.cache import PrefixTreeMask

    slots = 2 * max(contexts)
    keys = jax.random.split(jax.random.PRNGKey(0), 2 * LAYERS + 1)
    k = [jax.random.normal(keys[i], (1, slots, KV_HEADS, HEAD), jnp.float32) for i in range(LAYERS)]
    v = [jax.random.normal(keys[LAYERS + i], (1, slots, KV_HEADS, HEAD), jnp.float32) for i in range(LAYERS)]
    paths = {"XLA's prefix attention": False}  # name: whether `layers.attend` takes the CPU kernel
    if matmul.usable():
        paths = {"kernel": True, **paths}

    def chain(cpu_kernel, q, lengths, tree, k, v):  # each layer's output feeds the next layer's query
        x, mask = q, PrefixTreeMask(lengths, tree)
        for kl, vl in zip(k, v):
            x = layers.attend(x, kl, vl, mask, cpu_kernel).reshape(q.shape) * 1.0001
        return x

    ms = {}
    for name, cpu_kernel in paths.items():
        timed = jax.jit(lambda q, lengths, tree, k, v, c=cpu_kernel: chain(c, q, lengths, tree, k, v))
        for context in contexts:
            for t in ROWS:
                q = jax.random.normal(keys[-1], (1, t, HEADS, HEAD), jnp.float32)
                tree = jnp.tril(jnp.ones((t, t), bool))[None]
                ms[name, context, t] = report.median_us(timed, q, jnp.asarray([context], jnp.int32), tree, k, v,
                                                        repeats=args.repeats) / 1e3
    lines = [f"# {LAYERS} layers of decode-time attention, T query rows against one", "",
             f"- device: {device.describe()}", f"- date: {datetime.date.today().isoformat()}",
             f"- {HEADS} query / {KV_HEADS} KV heads of {HEAD}, fp32, a causal tree over the T rows, cache of {slots} "
             f"slots a layer; median of {args.repeats}", f"- CPU kernel: {matmul.isa() or matmul.unavailable()}", "",
             "| path | context | " + " | ".join(f"T = {t} ms" for t in ROWS) + " | "
             + " | ".join(f"T = {t} vs 1" for t in ROWS[1:]) + " |", "| --- | --- |" + " --- |" * (2 * len(ROWS) - 1)]
    lines += [f"| {name} | {c} | " + " | ".join(f"{ms[name, c, t]:.2f}" for t in ROWS) + " | "
              + " | ".join(f"{ms[name, c, t] / ms[name, c, 1]:.2f}x" for t in ROWS[1:]) + " |"
              for name in paths for c in contexts]
    report.write(args.out, "cpu_attention", "\n".join(lines))


if __name__ == "__main__":
    run(main)
