"""`python -m infer.tune`: choose each method's chain depth on this machine, from its step times and the speed model.

    python -m infer.tune [--model smollm2-135m] [--methods s3d,lookup,...] [--dtype float32] [--quant int8-all]
                         [--again]

A method run with its depth unset does this once by itself (`s3djax.defaults`); this command does it on purpose,
re-measures with --again (the CPU matmul's blocking too, `s3djax.kernel_tuning`), and prints each depth's step times
and predicted speed against `ar`, greedy and sampled
(temperature 0.7, top-p 0.9, where the record has it). --out also writes the table as DIR/tune.md.
"""

from __future__ import annotations

import datetime
import os

from s3djax import quant
from s3djax.cli import Parser, run

from s3djax.speed_model import DEPTH_OPTION, comparison_error

METHODS = tuple(DEPTH_OPTION)


def parse_args(argv=None):
    p = Parser(prog="python -m infer.tune", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="registry name, .gguf file or checkpoint folder")
    p.add_argument("--checkpoint", help="checkpoint folder for a registry shape such as llama-2-7b")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, from {', '.join(METHODS)}")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--quant", choices=quant.MODES)
    p.add_argument("--again", action="store_true", help="measure even where step times are cached")
    p.add_argument("--out", help="folder for tune.md")
    args = p.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    p.check(args, methods=bool(args.methods) and set(args.methods) <= set(METHODS))
    return args


def table(method: str, choices: dict) -> list[str]:
    """Markdown rows: each depth's step times and predicted speed, the chosen depths in bold, and in brackets the error
    of its comparison with the best (`speed_model.comparison_error`)."""
    costs = next(c.costs for c in choices.values() if c.costs)
    lines = [f"| {method} depth | the model's draft adds, ms | the rest of a step, ms | "
             + " | ".join(f"{name}: predicted vs `ar`" for name in choices) + " |",
             "| --- | --- | --- |" + " --- |" * len(choices)]
    for g in sorted(costs["verify"]):
        cells = []
        for c in choices.values():
            predicted = c.predicted or {0: 0.0}
            p, top = predicted.get(g), max(predicted, key=predicted.get)
            error = f" ({comparison_error(costs, g, top):.1%})" if g != top else ""
            cells.append("-" if p is None else f"**{p:.2f}x**{error}" if g == c.depth else f"{p:.2f}x{error}")
        lines.append(f"| {g} | {costs['draft'][g] * 1e3:.1f} | {costs['verify'][g] * 1e3:.1f} | " + " | ".join(cells)
                     + " |")
    return lines


def main(argv=None):
    args = parse_args(argv)
    from s3djax import defaults, device, kernel_tuning
    from s3djax.generator import Generator
    from s3djax.sampling import GREEDY, Sampling

    defaults.mode()  # a bad S3DJAX_DEFAULTS fails here, in one line
    if args.again:  # the CPU matmul's blocking too, chosen as the weights are laid out for it
        os.environ[defaults.ENV] = "again"
    gen = Generator(args.model, checkpoint=args.checkpoint, dtype=args.dtype, quant=args.quant)
    from cpu_kernels import matmul

    blocking = matmul.blocking()
    lines = [f"# Chain depths chosen on this machine, {args.model} {args.dtype}"
             + (f" {args.quant}" if args.quant else ""), "", f"- device: {device.describe()}",
             f"- date: {datetime.date.today().isoformat()}",
             f"- step times: `ar`'s and each depth's own decode loop (`defaults.measure_costs`), in a "
             f"{defaults.CACHE_LEN}-token cache, on the model's continuation of the timing text (`gate.PROMPT`), "
             f"stretches of {defaults.STRETCH} tokens from the same state, round robin ({defaults.ROUNDS} rounds or "
             f"more), a depth's step its median ratio to `ar`'s in the same round; the shallowest depth predicted "
             f"within its comparison's error (in brackets) of the best runs; what each depth commits: "
             f"configs/acceptance/{args.model}.json (`python -m train.acceptance`)"]
    if blocking:
        lines.append("- CPU matmul blocking, chosen on this machine (s3djax.kernel_tuning): "
                     + kernel_tuning.describe(blocking))
    lines.append("")
    for method in args.methods:
        choices = {}
        for name, sampling in (("greedy", GREEDY), ("sampled", Sampling(temperature=0.7, top_p=0.9))):
            # Measured (again, where asked) for the first; the second, whose steps are the same, reads the cache.
            os.environ[defaults.ENV] = "again" if args.again and name == "greedy" else "measure"
            choices[name] = gen.session(method, sampling=sampling).built.chosen
        found = {name: c for name, c in choices.items() if c is not None and c.costs}
        if not found:
            why = {c.how for c in choices.values() if c is not None} or {"a depth the data file fixes"}
            lines += [f"{method}: not chosen here, {'; '.join(sorted(why))}", ""]
            continue
        costs = next(iter(found.values())).costs
        lines += [f"{method}: `ar` step {costs['ar'] * 1e3:.1f} ms; chosen depth "
                  + ", ".join(f"{name} {c.depth}" for name, c in found.items()), ""] + table(method, found) + [""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "tune.md"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    run(main)
