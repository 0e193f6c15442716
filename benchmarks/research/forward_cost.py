"""What a forward over T new tokens costs against one token, on SmolLM2 at a real cache: the price of
verifying a draft. Speculation pays only where this stays near 1x (a memory-bound device). For a chain
of g drafts, a step costs draft(g) + verify(g + 1) and commits tau tokens, so reaching a speedup S over
`ar` takes tau = S * (draft + verify) / ar, and no draft, however good, commits more than g + 1. Each
method's draft and verify steps are timed at each chain length g with its shipped draft, drafting all g
tokens: Kangaroo at eta 0, S2D at thresholds 0 (every token leaves at the first, cheapest exit), and
`s3d-in-verify`, S3D drafting inside its verify forward of (g + 1)(g + 2) rows.

    python -m benchmarks.research.forward_cost [--methods s3d,kangaroo] [--gammas 1,2,4,8] [--max-cache-len 2048] [--repeats 10]
        [--paths kernel,xla] [--quant int8-all]

On the CPU, `--paths` times the native decode matmul (`cpu_kernels`, packed weights) and XLA's dot in
one process, each against its own T = 1.
"""

from __future__ import annotations

import dataclasses
import datetime

from benchmarks import report
from s3djax import quant
from s3djax.cli import Parser, run

TOKENS = (1, 2, 3, 4, 5, 6, 8, 9, 12, 17, 20)


PATHS = {"kernel": "kernel: the CPU decode matmul on packed weights (cpu_kernels)", "xla": "xla: XLA's dot"}

# The speed each method is meant to reach over `ar` (the project's goals on MT-Bench).
GOALS = {"s3d": 1.5, "s3d-in-verify": 1.5, "self-spec": 1.0, "kangaroo": 1.3, "s2d": 1.2}


def gamma_list(text: str) -> list[int]:
    return [int(g) for g in text.split(",")]


def method_list(text: str) -> list[str]:
    return text.split(",")


def chain_options(method: str, g: int) -> dict:
    """Build options for a chain of g drafts, every one of them drafted."""
    return {"s3d": dict(gamma=g), "s3d-in-verify": dict(gamma=g, in_verify="on"), "self-spec": dict(max_draft=g),
            "kangaroo": dict(max_draft=g, eta=0.0), "s2d": dict(max_draft=g, thresholds="0,0")}[method]


def main():
    p = Parser(prog="python -m benchmarks.research.forward_cost", description=__doc__.splitlines()[0])
    p.add_argument("--max-cache-len", type=int, default=2048)
    p.add_argument("--context", type=int, default=256, help="committed tokens in the cache")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--quant", choices=quant.MODES, default="none", help="int8 weights, as --quant")
    p.add_argument("--methods", default=list(GOALS), type=method_list,
                   help=f"speculative methods whose steps are timed (default {','.join(GOALS)})")
    p.add_argument("--gammas", default=[1, 2, 4, 8], type=gamma_list,
                   help="chain lengths (drafted tokens per step) whose steps are timed, e.g. 1,2,4,8")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--paths", default=["kernel"], type=method_list,
                   help="matmul paths to time, in order: kernel (the CPU kernel where it runs), xla")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    args.methods = [x for x in args.methods if x]
    p.check(args, gammas=all(g >= 1 and g + 1 in TOKENS for g in args.gammas),
            methods=set(args.methods) <= set(GOALS), paths=set(args.paths) <= {"kernel", "xla"})

    import jax.numpy as jnp

    from s3djax import device, methods
    from s3djax.decode import Runner
    from s3djax.loading import load_model
    from s3djax.speculative.profile import forward_step, ms_per_steps, step_times

    loaded = load_model("smollm2-135m", dtype=args.dtype, quantization=None if args.quant == "none" else args.quant)
    prompt = [(7 * i) % 1000 + 100 for i in range(args.context)]
    ms, steps, about = {}, {}, {}
    for path in args.paths:
        m = dataclasses.replace(loaded, config=loaded.config.replace(cpu_kernel=path == "kernel"))
        for method in args.methods or ["ar"]:
            for g in args.gammas if args.methods else [1]:
                options = chain_options(method, g) if method != "ar" else {}
                built = methods.build(method.removesuffix("-in-verify"), m, max_cache_len=args.max_cache_len,
                                      dtype=args.dtype, **options)
                about.setdefault(method, built.draft)
                state = Runner(built.decoder, built.params).prefill(prompt)
                if (path, 1) not in ms:
                    ar, params = (built.decoder, built.params) if method == "ar" else (built.decoder.ar, built.params[0])
                    length = state["length"]
                    forwards = {t: forward_step(ar, jnp.full((1, t), 100, jnp.int32), length) for t in TOKENS}
                    by_t, state["cache"] = ms_per_steps(forwards, params, state["cache"], args.repeats)
                    ms.update({(path, t): v for t, v in by_t.items()})
                if method != "ar":
                    steps[path, method, g] = step_times(built.decoder, built.params, state, repeats=args.repeats)
    first = args.paths[0]
    weights = "" if args.quant == "none" else f", weights {args.quant}"
    lines = [f"# Forward cost over T new tokens, SmolLM2-135M-Instruct {args.dtype}{weights}", "",
             f"- device: {device.describe()}", f"- date: {datetime.date.today().isoformat()}",
             f"- cache length {args.max_cache_len}, {args.context} committed tokens; causal attention and the full "
             f"LM head over all T; each run {args.repeats} times in a fori_loop carrying the cache, every T's loop in "
             f"turn 3 times, the fastest kept",
             f"- matmul paths: {', '.join(PATHS[p] for p in args.paths)}", "",
             "| T new tokens | " + " | ".join(f"{p} ms | {p} vs its T = 1" for p in args.paths)
             + (f" | {first} vs {args.paths[1]} |" if len(args.paths) > 1 else " |"),
             "| --- |" + " --- | --- |" * len(args.paths) + (" --- |" if len(args.paths) > 1 else "")]
    for t in TOKENS:
        cells = " | ".join(f"{ms[p, t]:.1f} | {ms[p, t] / ms[p, 1]:.2f}x" for p in args.paths)
        lines.append(f"| {t} | {cells} |" + (f" {ms[args.paths[1], t] / ms[first, t]:.2f}x faster |"
                                              if len(args.paths) > 1 else ""))
    if steps:
        lines += ["", "Chains of g drafts with each method's shipped draft, every draft made (Kangaroo at eta 0, S2D at "
                  "thresholds 0: each token leaves at the first exit). The tau a step must commit to break even with "
                  "`ar` (T = 1 above, same path) and to reach the method's goal, and the most any draft could reach: "
                  "every draft accepted (tau = g + 1) at this draft's cost, and at no draft cost at all.", ""]
        lines += [f"- {method}: {text}" for method, text in about.items() if method != "ar"]
        lines += ["", "| path | method | g | draft step ms | verify step ms | tau for 1.0x | goal | tau for the goal | "
                  "max tau | speedup, all accepted | speedup, all accepted, free draft |", "| --- |" + " --- |" * 10]
        for (path, method, g), t in steps.items():
            step, one = t["draft_step_ms"] + t["verify_step_ms"], ms[path, 1]
            lines.append(f"| {path} | {method} | {g} | {t['draft_step_ms']:.1f} | {t['verify_step_ms']:.1f} | "
                         f"{step / one:.2f} | {GOALS[method]}x | {GOALS[method] * step / one:.2f} | {g + 1} | "
                         f"{(g + 1) * one / step:.2f}x | {(g + 1) * one / t['verify_step_ms']:.2f}x |")
    report.write(args.out, "forward_cost", "\n".join(lines))


if __name__ == "__main__":
    run(main)
