"""A draft's LoRA adapters folded into its int8 copies against kept apart (S3D's, S2D's), in one process: what the
fold is worth to a decode on the machine at hand, greedy and sampled, with no process-to-process drift.

    python -m benchmarks.research.fold_ab [--method s3d] [--datasets mt-bench,humaneval] [--prompts 10]
        [--temperature 0.7 --top-p 0.9]

`ar`, the method folded and the method apart (`draft_weights.attach(fold=False)`, as before the fold) run each prompt
in turn, at the default flags. Reported per dataset: pooled tokens/s, against `ar`, tau, milliseconds per verify step
and, greedy, whether every output is `ar`'s; greedy, also each one's draft and verify steps timed apart (`step_times`,
after the first MT-Bench prompt).
"""

from __future__ import annotations

import dataclasses
import datetime

from benchmarks import report
from s3djax.cli import Parser, run


def main():
    p = Parser(prog="python -m benchmarks.research.fold_ab", description=__doc__.splitlines()[0])
    p.add_argument("--method", choices=("s3d", "s2d"), default="s3d")
    p.add_argument("--datasets", default="mt-bench,humaneval")
    p.add_argument("--prompts", type=int, default=10, help="the first prompts of each dataset")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    from s3djax.bench_data import DATASETS

    datasets = args.datasets.split(",")
    p.check(args, prompts=args.prompts >= 1, datasets=set(datasets) <= set(DATASETS))

    from s3djax import bench_data, device, methods
    from s3djax.decode import Runner
    from s3djax.loading import load_model
    from s3djax.sampling import Sampling
    from s3djax.speculative import draft_weights
    from s3djax.speculative.profile import step_times

    sampling = Sampling(args.temperature, top_p=args.top_p)
    m = load_model("smollm2-135m", progress=False)
    attach, runners = draft_weights.attach, {}
    variants = (("ar", "ar", True), (f"{args.method} folded", args.method, True),
                (f"{args.method} apart", args.method, False))
    for name, method, fold in variants:
        draft_weights.attach = lambda *a, keep=fold, **k: attach(*a, **{**k, "fold": keep and k.get("fold", False)})
        try:
            built = methods.build(method, m, max_cache_len=1024, sampling=sampling, measure=False)
        finally:
            draft_weights.attach = attach
        if method != "ar" and ("lora" in built.params[1]) == fold:
            raise RuntimeError(f"{name}: the draft's adapters were {'not ' if fold else ''}folded")
        runners[name] = Runner(built.decoder, built.params)
    lines = [f"# {args.method}'s adapters folded into its int8 draft copies against apart, SmolLM2-135M-Instruct float32", "",
             f"- device: {device.describe()}", f"- date: {datetime.date.today().isoformat()}",
             f"- temperature {args.temperature}, top-p {args.top_p}; each dataset's first {args.prompts} prompts, "
             f"{args.max_new_tokens} new tokens at most, seed = the prompt's index; one process, the three in turn on "
             "each prompt", "",
             "| dataset | decoder | tokens/s | vs `ar` | tau | ms per step | outputs `ar`'s |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for dataset in datasets:
        prompts = [q["ids"] for q in bench_data.prompts(dataset, m.tokenizer, args.prompts)]
        for r in runners.values():  # compiled before the clock
            r.generate(prompts[0], 8)
        pooled = {name: [0.0, 0, 0, []] for name in runners}
        for i, ids in enumerate(prompts):
            for name, r in runners.items():
                res, acc = r.generate(ids, args.max_new_tokens, seed=i), pooled[name]
                acc[0] += res.decode_s
                acc[1] += len(res.tokens)
                acc[2] += res.stats.get("verify_steps", len(res.tokens))
                acc[3].append(res.tokens)
        ar_rate = pooled["ar"][1] / pooled["ar"][0]
        for name, (secs, new, steps, outs) in pooled.items():
            same = "yes" if outs == pooled["ar"][3] else "no" if sampling.greedy else "sampled"
            lines.append(f"| {dataset} | {name} | {new / secs:.1f} | {new / secs / ar_rate:.3f}x | {new / steps:.2f} "
                         f"| {secs / steps * 1e3:.1f} | {same} |")
    if sampling.greedy:  # a sampled draft step draws with the loop's keys
        ids = bench_data.prompts("mt-bench", m.tokenizer, 1)[0]["ids"]
        lines += ["", "| decoder | `ar` step ms | draft step ms | verify step ms |", "| --- | --- | --- | --- |"]
        for name, r in runners.items():
            if name != "ar":  # the model's own draft, not lookup's where it gives way
                decoder = dataclasses.replace(r.decoder, drafter=getattr(r.decoder.drafter, "inner", r.decoder.drafter))
                ms = step_times(decoder, r.params, Runner(decoder, r.params).prefill(ids), repeats=20)
                lines.append(f"| {name} | {ms['ar_step_ms']:.1f} | {ms['draft_step_ms']:.1f} | {ms['verify_step_ms']:.1f} |")
    report.write(args.out, "fold_ab", "\n".join(lines))


if __name__ == "__main__":
    run(main)
