"""What sampling adds to a decode step: top-k / top-p and the draw, over SmolLM2's 49,152 logits, the fast
sampler against the full sort and `jax.random.categorical` it replaced, for one row (an `ar` step) and for
five (a gamma-4 chain's verify), beside a greedy `ar` step on the real model at a short cache.

    python -m benchmarks.research.sampling_cost [--repeats 50] [--out benchmarks/results]
"""

from __future__ import annotations

import datetime

from benchmarks import report
from s3djax.cli import run

SETTINGS = ((0.7, 0, 0.9), (1.0, 50, 1.0), (1.0, 0, 0.95), (0.7, 0, 1.0))


def main():
    args = report.timing_args("benchmarks.research.sampling_cost", __doc__, repeats=50)

    import jax
    import jax.numpy as jnp

    from s3djax import device, methods
    from s3djax.decode import Runner
    from s3djax.loading import load_model
    from s3djax.model import Decoder, forward_sequence
    from s3djax.sampling import Sampling, draw, process_logits, process_logits_reference
    from s3djax.speculative.profile import ms_per_step, step_functions
    from s3djax.tokenizer import encode_prompt

    m = load_model("smollm2-135m", progress=False)
    built = methods.build("ar", m, max_cache_len=512)
    state = Runner(built.decoder, built.params).prefill(encode_prompt(m.tokenizer, "Why is the sky blue?", True))
    step = step_functions(built.decoder)["ar_step_ms"]
    ar_ms = ms_per_step(lambda p, c: step(p, c, state["length"], state["last"]), built.params, (state["cache"], ()),
                        repeats=10)[0]
    key = jax.random.key(0)
    # SmolLM2's own logits after the last five positions of a prompt: a nucleus's width depends on them.
    ids = encode_prompt(m.tokenizer, "Write a short story about a lighthouse keeper.", True)
    hidden, _ = forward_sequence(m.params, jnp.asarray([ids], jnp.int32), config=m.config)
    logits = Decoder(m.config).apply({"params": m.params}, hidden[:, -5:], method="logits")  # [1, 5, V]

    def timed(fn, x):
        return report.median_us(jax.jit(fn), x, repeats=args.repeats) / 1e3

    lines = ["# What sampling adds to a step, SmolLM2's 49,152-token vocabulary", "",
             f"- device: {device.describe()}", f"- date: {datetime.date.today().isoformat()}; median of {args.repeats}",
             f"- a greedy `ar` step at a short cache: {ar_ms:.2f} ms", "",
             "ms per call; full sort: top-p by sorting the vocabulary, as before; fast: the cut searched among the "
             "largest logits first; categorical: `jax.random.categorical`; draw: one uniform per row, by inverse CDF.",
             "", "| temperature, top-k, top-p | rows | cut, full sort | cut, fast | cut + categorical | cut + draw, fast "
             "| fast vs before | before, share of an `ar` step | fast, share of an `ar` step |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for t, k, top_p in SETTINGS:
        s = Sampling(t, k, top_p)
        for rows in (1, 5):
            x = logits[:, :rows]
            full = timed(lambda l: process_logits_reference(l, s), x)
            fast = timed(lambda l: process_logits(l, s), x)
            before = timed(lambda l: jax.random.categorical(key, process_logits_reference(l, s), axis=-1), x)
            after = timed(lambda l: draw(key, process_logits(l, s)), x)
            lines.append(f"| {t}, {k}, {top_p} | {rows} | {full:.3f} | {fast:.3f} | {before:.3f} | {after:.3f} | "
                         f"{before / after:.1f}x | {before / ar_ms:.0%} | {after / ar_ms:.0%} |")
    report.write(args.out, "sampling_cost", "\n".join(lines))


if __name__ == "__main__":
    run(main)
