"""What a forward over T new tokens costs against one token, on SmolLM2 at a real cache: the price of
verifying a draft. Speculation pays only where this stays near 1x (a memory-bound device). For a chain
of g drafts, a step costs draft(g) + verify(g + 1) and commits tau tokens, so reaching a speedup S over
`ar` takes tau = S * (draft + verify) / ar, and no draft, however good, commits more than g + 1. Each
method's draft and verify steps are timed at each chain length g with its shipped draft, drafting all g
tokens: Kangaroo at eta 0, S2D at thresholds 0 (every token leaves at the first, cheapest exit).

    python -m benchmarks.forward_cost [--methods s3d,kangaroo] [--gammas 1,2,4,8] [--cache-len 2048] [--repeats 10]
"""

from __future__ import annotations

import datetime

from benchmarks import report
from infer.cli import Parser, run

TOKENS = (1, 2, 3, 4, 5, 8, 9, 17)


# The speed each method is meant to reach over `ar` (the project's goals on MT-Bench).
GOALS = {"s3d": 1.5, "self-spec": 1.0, "kangaroo": 1.3, "s2d": 1.2}


def gamma_list(text: str) -> list[int]:
    return [int(g) for g in text.split(",")]


def method_list(text: str) -> list[str]:
    return text.split(",")


def chain_options(method: str, g: int) -> dict:
    """Build options for a chain of g drafts, every one of them drafted."""
    return {"s3d": dict(gamma=g), "self-spec": dict(max_draft=g), "kangaroo": dict(max_draft=g, eta=0.0),
            "s2d": dict(max_draft=g, thresholds="0,0")}[method]


def main():
    p = Parser(prog="python -m benchmarks.forward_cost", description=__doc__.splitlines()[0])
    p.add_argument("--cache-len", type=int, default=2048)
    p.add_argument("--context", type=int, default=256, help="committed tokens in the cache")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--methods", default=list(GOALS), type=method_list,
                   help=f"speculative methods whose steps are timed (default {','.join(GOALS)})")
    p.add_argument("--gammas", default=[1, 2, 4, 8], type=gamma_list,
                   help="chain lengths (drafted tokens per step) whose steps are timed, e.g. 1,2,4,8")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    p.check(args, gammas=all(g >= 1 and g + 1 in TOKENS for g in args.gammas),
            methods=set(args.methods) <= set(GOALS))

    import jax.numpy as jnp

    from s3djax import device, methods
    from s3djax.decode import Runner
    from s3djax.loading import load_model
    from s3djax.speculative.profile import forward_step, ms_per_step, step_times

    m = load_model("smollm2-135m", dtype=args.dtype)
    prompt = [(7 * i) % 1000 + 100 for i in range(args.context)]
    ms, steps, about = {}, {}, {}
    for method in args.methods:
        for g in args.gammas:
            built = methods.build(method, m, max_cache_len=args.cache_len, dtype=args.dtype, **chain_options(method, g))
            about.setdefault(method, built.draft)
            state = Runner(built.decoder, built.params).prefill(prompt)
            if not ms:
                ar, params, cache, length = built.decoder.ar, built.params[0], state["cache"], state["length"]
                for t in TOKENS:
                    step = forward_step(ar, jnp.full((1, t), 100, jnp.int32), length)
                    ms[t], cache = ms_per_step(step, params, cache, args.repeats)
                state["cache"] = cache
            steps[method, g] = step_times(built.decoder, built.params, state, repeats=args.repeats)
    lines = [f"# Forward cost over T new tokens, SmolLM2-135M-Instruct {args.dtype}", "",
             f"- device: {device.describe()}", f"- date: {datetime.date.today().isoformat()}",
             f"- cache length {args.cache_len}, {args.context} committed tokens; causal attention and the full "
             f"LM head over all T; each run {args.repeats} times in a fori_loop carrying the cache, median of 3", "",
             "| T new tokens | ms | vs T = 1 |", "| --- | --- | --- |"]
    lines += [f"| {t} | {ms[t]:.1f} | {ms[t] / ms[1]:.2f}x |" for t in TOKENS]
    lines += ["", "Chains of g drafts with each method's shipped draft, every draft made (Kangaroo at eta 0, S2D at "
              "thresholds 0: each token leaves at the first exit). The tau a step must commit to break even with "
              "`ar` (T = 1 above) and to reach the method's goal, and the most any draft could reach: every "
              "draft accepted (tau = g + 1) at this draft's cost, and at no draft cost at all.", ""]
    lines += [f"- {method}: {text}" for method, text in about.items()]
    lines += ["", "| method | g | draft step ms | verify step ms | tau for 1.0x | goal | tau for the goal | max tau | "
              "speedup, all accepted | speedup, all accepted, free draft |", "| --- |" + " --- |" * 9]
    for (method, g), t in steps.items():
        step = t["draft_step_ms"] + t["verify_step_ms"]
        lines.append(f"| {method} | {g} | {t['draft_step_ms']:.1f} | {t['verify_step_ms']:.1f} | {step / ms[1]:.2f} | "
                     f"{GOALS[method]}x | {GOALS[method] * step / ms[1]:.2f} | {g + 1} | {(g + 1) * ms[1] / step:.2f}x | "
                     f"{(g + 1) * ms[1] / t['verify_step_ms']:.2f}x |")
    report.write(args.out, "forward_cost", "\n".join(lines))


if __name__ == "__main__":
    run(main)
