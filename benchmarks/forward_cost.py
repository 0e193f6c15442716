"""What a forward over T new tokens costs against one token, on SmolLM2 at a real cache: the price of
verifying a draft. Speculation pays only where this stays near 1x (a memory-bound device). For a chain
of gamma drafts, a step costs draft(gamma) + forward(gamma + 1) and commits tau tokens, so reaching a
speedup S over `ar` takes tau = S * (draft + forward(gamma + 1)) / forward(1), and no draft, however
good, commits more than gamma + 1.

    python -m benchmarks.forward_cost [--cache-len 2048] [--context 256] [--gammas 1,2,4,8] [--repeats 10]
"""

from __future__ import annotations

import datetime

from benchmarks import report
from infer.cli import Parser, run

TOKENS = (1, 2, 3, 4, 5, 8, 9, 17)


def gamma_list(text: str) -> list[int]:
    return [int(g) for g in text.split(",")]


def main():
    p = Parser(prog="python -m benchmarks.forward_cost", description=__doc__.splitlines()[0])
    p.add_argument("--cache-len", type=int, default=2048)
    p.add_argument("--context", type=int, default=256, help="committed tokens in the cache")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--gammas", default=[1, 2, 4, 8], type=gamma_list,
                   help="chain depths whose draft step is timed, e.g. 1,2,4,8")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    p.check(args, gammas=all(g >= 1 and g + 1 in TOKENS for g in args.gammas))

    import jax.numpy as jnp

    from s3djax import device, methods
    from s3djax.decode import Runner
    from s3djax.loading import load_model
    from s3djax.speculative.profile import forward_step, ms_per_step, step_times

    m = load_model("smollm2-135m", dtype=args.dtype)
    prompt = [(7 * i) % 1000 + 100 for i in range(args.context)]
    draft_ms, ms = {}, {}
    for gamma in args.gammas:
        built = methods.build("s3d", m, max_cache_len=args.cache_len, dtype=args.dtype, gamma=gamma)
        state = Runner(built.decoder, built.params).prefill(prompt)
        if not ms:
            ar, params, cache, length = built.decoder.ar, built.params[0], state["cache"], state["length"]
            for t in TOKENS:
                step = forward_step(ar, jnp.full((1, t), 100, jnp.int32), length)
                ms[t], cache = ms_per_step(step, params, cache, args.repeats)
            state["cache"] = cache
        draft_ms[gamma] = step_times(built.decoder, built.params, state, repeats=args.repeats)["draft_step_ms"]
    lines = [f"# Forward cost over T new tokens, SmolLM2-135M-Instruct {args.dtype}", "",
             f"- device: {device.describe()}", f"- date: {datetime.date.today().isoformat()}",
             f"- cache length {args.cache_len}, {args.context} committed tokens; causal attention and the full "
             f"LM head over all T; each run {args.repeats} times in a fori_loop carrying the cache, median of 3", "",
             "| T new tokens | ms | vs T = 1 |", "| --- | --- | --- |"]
    lines += [f"| {t} | {ms[t]:.1f} | {ms[t] / ms[1]:.2f}x |" for t in TOKENS]
    lines += ["", f"S3D chains with the shipped draft ({built.draft.replace(f', gamma {gamma}', '')}): the tau a step must "
              "commit to break even with `ar` and to reach 1.5x, and the most any draft could reach: every "
              "draft accepted (tau = gamma + 1) at this draft's cost, and at no draft cost at all.", "",
              "| gamma | draft step ms | verify forward ms | tau for 1.0x | tau for 1.5x | max tau | "
              "speedup, all accepted | speedup, all accepted, free draft |", "| --- |" + " --- |" * 7]
    for g in args.gammas:
        step = draft_ms[g] + ms[g + 1]
        lines.append(f"| {g} | {draft_ms[g]:.1f} | {ms[g + 1]:.1f} | {step / ms[1]:.2f} | {1.5 * step / ms[1]:.2f} | "
                     f"{g + 1} | {(g + 1) * ms[1] / step:.2f}x | {(g + 1) * ms[1] / ms[g + 1]:.2f}x |")
    report.write(args.out, "forward_cost", "\n".join(lines))


if __name__ == "__main__":
    run(main)
