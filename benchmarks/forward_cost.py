"""What a forward over T new tokens costs against one token, on SmolLM2 at a real cache: the price of
verifying a draft. Speculation pays only where this stays near 1x (a memory-bound device); then the
break-even tau of a chain of gamma drafts is (draft step + forward(gamma + 1)) / forward(1).

    python -m benchmarks.forward_cost [--cache-len 2048] [--context 256] [--repeats 10]
"""

from __future__ import annotations

import datetime

from benchmarks import report
from infer.cli import Parser, run

TOKENS = (1, 2, 3, 4, 5, 8, 9, 17)


def main():
    p = Parser(prog="python -m benchmarks.forward_cost", description=__doc__.splitlines()[0])
    p.add_argument("--cache-len", type=int, default=2048)
    p.add_argument("--context", type=int, default=256, help="committed tokens in the cache")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()

    import jax.numpy as jnp

    from s3djax import device, methods
    from s3djax.decode import Runner
    from s3djax.loading import load_model
    from s3djax.speculative.profile import forward_step, ms_per_step, step_times

    m = load_model("smollm2-135m", dtype=args.dtype)
    built = methods.build("s3d", m, max_cache_len=args.cache_len, dtype=args.dtype)
    ar, (params, _) = built.decoder.ar, built.params
    state = Runner(built.decoder, built.params).prefill([(7 * i) % 1000 + 100 for i in range(args.context)])
    cache, length = state["cache"], state["length"]

    ms = {}
    for t in TOKENS:
        step = forward_step(ar, jnp.full((1, t), 100, jnp.int32), length)
        ms[t], cache = ms_per_step(step, params, cache, args.repeats)
    state["cache"] = cache
    draft_ms = step_times(built.decoder, built.params, state, repeats=args.repeats)["draft_step_ms"]
    gamma = built.decoder.drafter.gamma
    lines = [f"# Forward cost over T new tokens, SmolLM2-135M-Instruct {args.dtype}", "",
             f"- device: {device.describe()}", f"- date: {datetime.date.today().isoformat()}",
             f"- cache length {args.cache_len}, {args.context} committed tokens; causal attention and the full "
             f"LM head over all T; each run {args.repeats} times in a fori_loop carrying the cache, median of 3", "",
             "| T new tokens | ms | vs T = 1 |", "| --- | --- | --- |"]
    lines += [f"| {t} | {ms[t]:.1f} | {ms[t] / ms[1]:.2f}x |" for t in TOKENS]
    lines += ["", f"S3D draft step (gamma {gamma}, {built.draft}): {draft_ms:.1f} ms. A chain of {gamma} drafts "
              f"breaks even with `ar` at tau = (draft + forward({gamma + 1})) / forward(1) = "
              f"{(draft_ms + ms[gamma + 1]) / ms[1]:.2f} tokens per step."]
    report.write(args.out, "forward_cost", "\n".join(lines))


if __name__ == "__main__":
    run(main)
