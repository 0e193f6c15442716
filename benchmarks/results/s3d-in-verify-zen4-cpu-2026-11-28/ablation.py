"""Acceptance (not speed) of S3D drafting inside the verify pass, one piece taken away at a time: the record of how
ablation.json was made (2026-11-28, 2-core Zen 4, jax 0.10.2), run from the repository root as
`.venv/bin/python benchmarks/results/s3d-in-verify-zen4-cpu-2026-11-28/ablation.py 20 OUT.json`: MT-Bench's first
20 first turns and HumanEval's first 10, 128 new tokens, greedy, every output checked against `ar`."""
import dataclasses, json, sys
from s3djax import methods
from s3djax.bench_data import prompts
from s3djax.decode import Runner
from s3djax.loading import load_model
from s3djax.skip_plan import SkipPlan
from s3djax.speculative.loop import SpecDecoder, acceptance

n = int(sys.argv[1]) if len(sys.argv) > 1 else 20
m = load_model("smollm2-135m", progress=False)
sets = {d: [q["ids"] for q in prompts(d, m.tokenizer, lim)] for d, lim in (("mt-bench", n), ("humaneval", n // 2))}
ar = methods.build("ar", m, max_cache_len=2048)
ar = Runner(ar.decoder, ar.params)
expected = {d: [ar.generate(p, 128).tokens for p in ps] for d, ps in sets.items()}
rows = []
for gamma in (1, 2):
    base = methods.build("s3d", m, max_cache_len=2048, in_verify="on", gamma=gamma, lookup=0)
    target, draft = base.params
    d = base.decoder.drafter
    variants = {
        "in-verify (draft plan, correction)": (d, draft),
        "without the correction": (d, {k: v for k, v in draft.items() if k != "correction"}),
        "branches through the full model": (dataclasses.replace(d, plan=SkipPlan.full(d.plan.num_layers)), draft),
    }
    std = methods.build("s3d", m, max_cache_len=2048, in_verify="off", gamma=gamma + 1, lookup=0)
    variants[f"draft step, gamma {gamma + 1}"] = (std.decoder.drafter, std.params[1])
    for name, (drafter, dr) in variants.items():
        runner = Runner(SpecDecoder.create(base.decoder.ar, drafter), (target, dr))
        row = {"gamma": gamma, "variant": name}
        for s, ps in sets.items():
            acc = []
            for p, want in zip(ps, expected[s]):
                got = runner.generate(p, 128)
                assert got.tokens == want
                acc += got.stats["accepted_per_step"]
            a = acceptance(acc, drafter.tree.depth)
            row[s] = {"tau": round(a["mean_accepted_tokens"], 3), "alpha": [round(x, 3) for x in a["acceptance_by_depth"]]}
        print(json.dumps(row), flush=True)
        rows.append(row)
json.dump(rows, open(sys.argv[2] if len(sys.argv) > 2 else "/tmp/iv/ablate.json", "w"), indent=1)
