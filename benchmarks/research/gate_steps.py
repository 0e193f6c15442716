"""What the pause gate's measured step times are made of: for s3d and self-spec giving way to prompt lookup (their CPU
default), greedy and sampled, a step drafted by the model, one lookup drafted (free), and a paused one, as `gate.measure`
times them in the method's compiled loop, on the gate's prompt raw and under the chat template. One breakeven for
every drafting step was whatever mix of the two the measurement's stretches took (docs/sampling.md).

    python -m benchmarks.research.gate_steps [--repeats 2] [--out benchmarks/results]
"""

from __future__ import annotations

import dataclasses
import datetime

from benchmarks import report
from s3djax.cli import run

SAMPLINGS = {"greedy": {}, "0.7 / top-p 0.9": {"temperature": 0.7, "top_p": 0.9}}


def main():
    args = report.timing_args("benchmarks.research.gate_steps", __doc__, repeats=2)

    from s3djax import Generator, device
    from s3djax.sampling import Sampling
    from s3djax.speculative import gate
    from s3djax.tokenizer import encode_prompt

    gen = Generator("smollm2-135m", progress=False)
    lines = ["# The pause gate's step times, SmolLM2-135M-Instruct fp32", "", f"- device: {device.describe()}",
             f"- date: {datetime.date.today().isoformat()}",
             f"- `gate.measure` in each method's compiled loop (its default options, lookup giving way), fastest of "
             f"{args.repeats} measurements; ms a step; breakeven: drafts a step must accept to pay", "",
             "| method | sampling | prompt | model's step | free step (lookup) | paused step | breakeven | free breakeven |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for method in ("s3d", "self-spec"):
        for name, sampling in SAMPLINGS.items():
            runner = gen.session(method, sampling=Sampling(**sampling), pause="off").runner
            runner.decoder = dataclasses.replace(runner.decoder, gate=True)
            for chat in (False, True):
                ids = encode_prompt(gen.tokenizer, gate.PROMPT, chat)
                found = [gate.measure(runner, ids) for _ in range(args.repeats)]
                best = {k: min(f[k] for f in found if k in f) for k in ("draft_s", "pause_s", "free_s")
                        if any(k in f for f in found)}
                free = best.get("free_s")
                lines.append(f"| {method} | {name} | {'chat template' if chat else 'raw'} | {best['draft_s'] * 1e3:.1f} | "
                             + (f"{free * 1e3:.1f}" if free is not None else "-") + f" | {best['pause_s'] * 1e3:.1f} | "
                             f"{best['draft_s'] / best['pause_s'] - 1:.2f} | "
                             + (f"{free / best['pause_s'] - 1:.2f}" if free is not None else "-") + " |")
    report.write(args.out, "gate_steps", "\n".join(lines))


if __name__ == "__main__":
    run(main)
