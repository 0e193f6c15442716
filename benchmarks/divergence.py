"""`python -m benchmarks.divergence DIR/results.json`: where each method's greedy output first leaves `ar`'s, and
how far apart `ar`'s token and the method's were there, scored by the model in float32 on this machine.

Greedy speculative decoding is exactly lossless where a verify pass computes the same numbers as an AR step. In
bfloat16 on a GPU it does not: a verify over several tokens runs other matrix kernels than a one-token step, so a
near-tie between the two best tokens can round the other way, and from there the outputs part. A divergence is
such a near-tie when the float32 logits of the two tokens differ by at most --tie (default 0.25: two bfloat16
steps at logits of 16 to 32). It is also rounding, and not the method's error, where float32 picks the method's
token: `ar` rounded the other way. Anything else is unexplained, and a bug until shown otherwise.

    python -m benchmarks.divergence benchmarks/results/gpu-suite-*/bench-mt-bench-bf16-xla/results.json
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from s3djax.cli import Parser, run
from s3djax.errors import UserError


PICKS = {"ar": "ar's token", "other": "the method's"}


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two outputs differ, None when identical; one ending early differs where it ended."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def divergences(record: dict) -> list[dict]:
    """Every (dataset, method, prompt) whose output differs from `ar`'s, with where it first differs."""
    out = []
    for dataset, per in record["runs"].items():
        ar = {r["id"]: r["tokens"] for r in per["ar"]}
        for method, runs in per.items():
            if method == "ar":
                continue
            for r in runs:
                at = first_difference(ar[r["id"]], r["tokens"])
                if at is not None:
                    out.append({"dataset": dataset, "method": method, "id": r["id"], "at": at,
                                "ar": ar[r["id"]][at] if at < len(ar[r["id"]]) else None,
                                "other": r["tokens"][at] if at < len(r["tokens"]) else None})
    return out


def scorer(model):
    """float32 logits after a token sequence: one jitted forward per 64-token length bucket."""
    import jax
    import jax.numpy as jnp

    from s3djax.model import Decoder, forward_sequence

    @jax.jit
    def last_logits(tokens, length):
        hidden, _ = forward_sequence(model.params, tokens[None], config=model.config)
        row = jax.lax.dynamic_index_in_dim(hidden[0], length - 1, keepdims=False)
        return Decoder(model.config).apply({"params": model.params}, row[None], method=Decoder.logits)[0]

    def score(ids: list[int]) -> np.ndarray:
        padded = np.zeros(-(-len(ids) // 64) * 64, np.int32)  # later positions never reach earlier ones (causal)
        padded[:len(ids)] = ids
        return np.asarray(last_logits(jnp.asarray(padded), len(ids)), np.float32)

    return score


def main(argv=None):
    p = Parser(prog="python -m benchmarks.divergence", description=__doc__.split("\n\n")[0])
    p.add_argument("results", help="an infer.benchmark results.json (greedy, with its outputs' tokens)")
    p.add_argument("--tie", type=float, default=0.25, help="the widest float32 logit margin that counts as a near-tie")
    p.add_argument("--out", help="also write the report here (markdown)")
    args = p.parse_args(argv)
    p.check(args, tie=args.tie >= 0)
    try:
        with open(args.results) as f:
            record = json.load(f)
        settings = record["settings"]
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"cannot read {args.results} as an infer.benchmark results.json: {e}") from None
    if settings.get("temperature", 0) != 0:
        raise UserError(f"{args.results} was sampled (temperature {settings['temperature']}): only greedy outputs "
                        "must equal ar's")

    from s3djax import bench_data
    from s3djax.loading import load_model

    found = divergences(record)
    checkpoint = settings.get("checkpoint")
    if checkpoint and not os.path.isfile(checkpoint):  # a GPU machine's carried copy of the registry's model
        print(f"{checkpoint} is not here: scoring with {settings['model']} from its package", file=sys.stderr)
        checkpoint = None
    model = load_model(settings["model"], checkpoint=checkpoint, dtype="float32", progress=False)
    prompts = {d: {q["id"]: q["ids"] for q in bench_data.prompts(d, model.tokenizer, None,
                                                                 mt_bench_turns=settings.get("mt_bench_turns", 1))}
               for d in {x["dataset"] for x in found}}
    ar = {(d, r["id"]): r["tokens"] for d, per in record["runs"].items() for r in per["ar"]}
    score = scorer(model)
    for i, x in enumerate(found, 1):
        print(f"\rscoring divergence {i}/{len(found)}", end="", file=sys.stderr, flush=True)
        if x["ar"] is None or x["other"] is None:  # one stopped (EOS or a length cap) where the other went on
            x.update(margin=None, float32_pick=None)
            continue
        logits = score(prompts[x["dataset"]][x["id"]] + ar[(x["dataset"], x["id"])][:x["at"]])
        x.update(margin=round(float(logits[x["ar"]] - logits[x["other"]]), 4),
                 float32_pick="ar" if logits[x["ar"]] >= logits[x["other"]] else "other",
                 float32_top=int(np.argmax(logits)))
    print(file=sys.stderr)
    report = markdown(record, found, args.tie, os.path.relpath(args.results))
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report + "\n")


def markdown(record: dict, found: list[dict], tie: float, name: str) -> str:
    lines = [f"# Divergences from ar: {name}",
             "", f"- run: {record['device']}, {record['date']}, commit {record['commit']}, {record['settings']['dtype']}",
             f"- scored in float32 on this machine; a near-tie is a margin of at most {tie} between ar's token's "
             "logit and the method's", "",
             "| dataset | method | prompts | identical | near-ties | float32 picks the method's | unexplained | "
             "ended apart | widest margin |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for dataset, per in record["runs"].items():
        for method, runs in per.items():
            if method == "ar":
                continue
            mine = [x for x in found if x["dataset"] == dataset and x["method"] == method]
            scored = [x for x in mine if x["margin"] is not None]
            ties = [x for x in scored if abs(x["margin"]) <= tie]
            sides = [x for x in scored if abs(x["margin"]) > tie and x["float32_pick"] == "other"]
            lines.append(f"| {dataset} | {method} | {len(runs)} | {len(runs) - len(mine)} | {len(ties)} | {len(sides)} | "
                         f"{len(scored) - len(ties) - len(sides)} | {len(mine) - len(scored)} | "
                         f"{max((abs(x['margin']) for x in scored), default=0):.3f} |")
    wide = [x for x in found if x["margin"] is not None and abs(x["margin"]) > tie]
    if wide:
        lines += ["", f"Margins wider than {tie}:", ""]
        lines += [f"- {x['dataset']} {x['method']} prompt {x['id']}, token {x['at']}: ar {x['ar']}, "
                  f"{x['method']} {x['other']}, margin {x['margin']}, float32 picks {PICKS[x['float32_pick']]}" for x in wide]
    return "\n".join(lines)


if __name__ == "__main__":
    run(main)
