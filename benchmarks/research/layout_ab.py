"""The CPU kernel's one-row tiles and joined products, each on and off, in one process: what each is worth to a
method's decode on the machine at hand, with no process-to-process drift (which on a shared VM moves a whole run by
10% or more, more than either change).

    python -m benchmarks.research.layout_ab [--methods ar,s3d] [--prompts 6] [--rounds 2] [--dtype bfloat16] [--quant int8-all]

Two generators are built on the same weights, one with q/k/v and gate/up joined before packing (`quant.pack_for_cpu`)
and one with them apart; each runs MT-Bench's first prompts under one panel and two panels a one-row tile
(`row_panels`), in turn, every round, the fastest round kept. Greedy: every variant's tokens must be the same.
"""

from __future__ import annotations

import datetime

from benchmarks import report
from s3djax import quant
from s3djax.cli import Parser, run


def main():
    p = Parser(prog="python -m benchmarks.research.layout_ab", description=__doc__.splitlines()[0])
    p.add_argument("--methods", default="ar,s3d")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--quant", choices=quant.MODES, default="none")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    from s3djax.methods import METHODS

    p.check(args, prompts=args.prompts >= 1, rounds=args.rounds >= 1, methods=set(args.methods.split(",")) <= set(METHODS))

    import s3djax
    from cpu_kernels import matmul
    from s3djax import bench_data, device
    from s3djax.errors import UserError

    if not matmul.usable():
        raise UserError(f"the CPU matmul kernel does not run here ({matmul.unavailable()})")
    methods, gens, joined = args.methods.split(","), {}, quant._join_for_cpu
    for layout in ("apart", "joined"):
        quant._join_for_cpu = joined if layout == "joined" else (lambda ws: None)
        try:
            gens[layout] = gen = s3djax.Generator("smollm2-135m", dtype=args.dtype, quant=None if args.quant == "none" else args.quant,
                                                  max_cache_len=1024, progress=False)
            prompts = [q["text"] for q in bench_data.prompts("mt-bench", gen.tokenizer, args.prompts)]
            for method in methods:  # built, and compiled, under this layout
                gen.generate(prompts[0], max_new_tokens=4, method=method)
        finally:
            quant._join_for_cpu = joined
    chosen = matmul.blocking()
    speed, tokens = {}, {}
    for _ in range(args.rounds):
        for panels in (1, 2):
            matmul.set_blocking({**chosen, "row_panels": panels})
            for layout, gen in gens.items():
                for method in methods:
                    outs = [gen.generate(q, max_new_tokens=args.max_new_tokens, method=method) for q in prompts]
                    new = sum(len(o.token_ids) - 1 for o in outs)
                    rate = new / sum((len(o.token_ids) - 1) / o.tokens_per_s for o in outs)
                    key = (method, layout, panels)
                    speed[key] = max(speed.get(key, 0.0), rate)
                    tokens.setdefault(key, [o.token_ids for o in outs])
    matmul.set_blocking(chosen)
    same = all(len({str(tokens[m, lay, rp]) for lay in gens for rp in (1, 2)}) == 1 for m in methods)
    weights = args.dtype if args.quant == "none" else f"{args.dtype}, {args.quant}"
    lines = [f"# One-row tiles and joined products on and off, SmolLM2-135M-Instruct {weights}", "",
             f"- device: {device.describe()}", f"- date: {datetime.date.today().isoformat()}",
             f"- MT-Bench's first {args.prompts} prompts, greedy, {args.max_new_tokens} new tokens at most; one process, "
             f"every variant in turn each of {args.rounds} rounds, the fastest kept; blocking chosen here: "
             + ", ".join(f"{k} {v}" for k, v in chosen.items() if k != "row_panels"),
             f"- every variant's tokens the same as the first's, method by method: {same}", "",
             "| method | apart, 1 panel | apart, 2 panels | joined, 1 panel | joined, 2 panels | both against neither |",
             "| --- | --- | --- | --- | --- | --- |"]
    for m in methods:
        cells = [speed[m, lay, rp] for lay in ("apart", "joined") for rp in (1, 2)]
        lines.append(f"| {m} | " + " | ".join(f"{c:.1f}" for c in cells) + f" | {cells[3] / cells[0]:.2f}x |")
    report.write(args.out, "layout_ab", "\n".join(lines))


if __name__ == "__main__":
    run(main)
