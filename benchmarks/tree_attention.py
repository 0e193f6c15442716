"""The Pallas tree-attention kernel against the XLA path (and tokamax where installed), one process.

    python -m benchmarks.tree_attention [--quick]

Shapes: SmolLM2 (9 query / 3 KV heads, head_dim 64) and 7B-class (32 / 32, head_dim 128), cache
lengths 512-8192, T in {1, 16, 64}, bf16, the prefix filling the cache but for the T new slots.
Bandwidth counts each K/V byte of the prefix read once, against a measured device copy.
On CPU the kernel runs in interpret mode: the table then checks the script, not the kernel's speed.
"""

from __future__ import annotations

import datetime

import jax
import jax.numpy as jnp

from benchmarks import report
from benchmarks.report import copy_bandwidth, median_us
from s3djax.cli import Parser, run


def main():
    p = Parser(prog="python -m benchmarks.tree_attention", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="two small shapes (a CPU check of the script)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()

    from jax.experimental.pallas.ops.gpu import decode_attention

    from pallas_kernels.tree_attention import tree_attention
    from s3djax import device
    from s3djax.cache import PrefixTreeMask
    from s3djax.layers import attend

    models = {"smollm2 (9/3 heads, d64)": (9, 3, 64), "7B-class (32/32 heads, d128)": (32, 32, 128)}
    lengths, ts = ([512, 2048], [1, 16]) if args.quick else ([512, 2048, 4096, 8192], [1, 16, 64])
    if args.quick:
        models = {"smollm2 (9/3 heads, d64)": models["smollm2 (9/3 heads, d64)"]}
    def xla(q, kc, vc, length, kn, vn, tree):  # what the model runs with attention="xla"
        return attend(q, kc, vc, PrefixTreeMask(length, tree))

    def jax_decode(q, kc, vc, length, kn, vn, tree):  # jax's own GPU decode kernel: one query, the prefix only
        return decode_attention.gqa(q[:, 0], kc, vc, kv_seq_len=length, interpret=jax.default_backend() == "cpu")

    peers = {"xla": jax.jit(xla), "pallas": tree_attention}
    try:
        import tokamax  # noqa: F401  (a dense-mask peer where installed)
    except ImportError:
        tokamax = None
    bw = copy_bandwidth(args.repeats)
    lines = ["# Tree attention: Pallas kernel vs XLA, bf16", "", f"- device: {device.describe()}",
             f"- date: {datetime.date.today().isoformat()}", f"- measured copy bandwidth: {bw / 1e9:.1f} GB/s",
             f"- tokamax: {'installed' if tokamax else 'not installed (no dense-mask peer)'}", "",
             "- jax decode: jax's own `pallas/ops/gpu/decode_attention.gqa`, for T = 1 only (it attends the prefix, "
             "without the new token)", "",
             "| shape | cache | T | XLA µs | Pallas µs | jax decode µs | speed-up | Pallas GB/s | of copy bandwidth |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, (heads, kv_heads, d) in models.items():
        for s in lengths:
            for t in ts:
                ks = jax.random.split(jax.random.key(s + t), 5)
                q = jax.random.normal(ks[0], (1, t, heads, d), jnp.bfloat16)
                kc, vc = (jax.random.normal(k, (1, s, kv_heads, d), jnp.bfloat16) for k in ks[1:3])
                kn, vn = (jax.random.normal(k, (1, t, kv_heads, d), jnp.bfloat16) for k in ks[3:5])
                tree = jnp.tril(jnp.ones((1, t, t), bool))
                length = jnp.asarray([s - t], jnp.int32)
                us = {k: median_us(f, q, kc, vc, length, kn, vn, tree, repeats=args.repeats)
                      for k, f in {**peers, **({"jax decode": jax_decode} if t == 1 else {})}.items()}
                moved = 2 * (s - t) * kv_heads * d * 2  # K and V of the prefix, bf16
                rate = moved / (us["pallas"] * 1e-6)
                peer = f"{us['jax decode']:.0f}" if t == 1 else "-"
                lines.append(f"| {name} | {s} | {t} | {us['xla']:.0f} | {us['pallas']:.0f} | {peer} | "
                             f"{us['xla'] / us['pallas']:.2f}x | {rate / 1e9:.1f} | {rate / bw:.0%} |")
    report.write(args.out, "tree_attention" + ("_quick" if args.quick else ""), "\n".join(lines))


if __name__ == "__main__":
    run(main)
