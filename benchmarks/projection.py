"""A 7B-class projection: S3D tokens/s from measured step times and measured acceptance.

The AR step, the S3D draft step and the verify step are timed on Llama-2-7B and Phi-3-mini shapes
with random weights (bf16 and int8); tau comes from a real `infer.benchmark` run on SmolLM2. The
projected speed-up is tau x AR step / (draft step + verify step). It is a projection, labelled so
everywhere: the acceptance of a 7B model's own trained draft is not measured.

    python -m benchmarks.projection --acceptance benchmarks/results/archive/benchmark-mt-bench-5-cpu/results.json [--quick]
"""

from __future__ import annotations

import datetime
import json
import sys

from benchmarks import report
from s3djax.cli import Parser, run


def main():
    p = Parser(prog="python -m benchmarks.projection", description=__doc__.splitlines()[0])
    p.add_argument("--acceptance", required=True, help="an infer.benchmark results.json with an s3d row")
    p.add_argument("--dataset", default="mt-bench")
    p.add_argument("--quick", action="store_true", help="a 1/16-width, 2-layer Llama-2-7B stand-in: a CPU check of the script")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--max-cache-len", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()

    import jax
    import jax.numpy as jnp

    from s3djax import device, model, quant, registry
    from s3djax.decode import ARDecoder, Runner
    from s3djax.errors import UserError
    from s3djax.speculative.drafters.s3d import default_plan
    from s3djax.speculative.draft_params import init_draft
    from s3djax.speculative.drafters.s3d import S3DDrafter
    from s3djax.speculative.loop import SpecDecoder
    from s3djax.speculative.profile import step_times
    from s3djax.speculative.tree import TreeSpec

    try:
        with open(args.acceptance) as f:
            measured = json.load(f)
        s3d = measured["summary"][args.dataset]["s3d"]
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"{args.acceptance} has no s3d result on {args.dataset} ({e})") from None
    gamma = measured["settings"]["gamma"]
    if gamma is None:
        raise UserError(f"{args.acceptance} does not record the gamma it ran with; rerun infer.benchmark")
    if measured["settings"]["tree"] not in (None, "chain"):  # None: s3d's default, the chain
        raise UserError("the projection times a chain verify step; pass a results.json measured with --tree chain")
    rows = []
    for name in ("llama-2-7b",) if args.quick else ("llama-2-7b", "phi-3-mini-4k"):
        config = registry.lookup(name).config()
        if args.quick:
            config = config.replace(num_layers=2, hidden_size=config.hidden_size // 16,
                                    intermediate_size=config.intermediate_size // 16,
                                    num_heads=config.num_heads // 16, num_kv_heads=config.num_kv_heads // 16)
        plan = default_plan(config.num_layers)
        for weights in ("bf16", "int8"):
            print(f"{name} {weights}...", file=sys.stderr, flush=True)
            params = model.init_params(config, jax.random.key(0), jnp.bfloat16)
            if weights == "int8":
                params = quant.apply(params, "int8", jnp.bfloat16)
            draft = init_draft(params, config, plan)
            decoder = SpecDecoder.create(ARDecoder(config, args.max_cache_len, eos_ids=(), cache_dtype="bfloat16"),
                                         S3DDrafter(config, plan, TreeSpec.chain(gamma), gamma))
            state = Runner(decoder, (params, draft)).prefill(list(range(1, args.context + 1)))
            ms = step_times(decoder, (params, draft), state, repeats=args.repeats)
            ar_tps = 1000 / ms["ar_step_ms"]
            s3d_tps = s3d["tau"] * 1000 / (ms["draft_step_ms"] + ms["verify_step_ms"])
            rows.append(f"| {name}{' (stand-in)' if args.quick else ''} | {weights} | {quant.param_bytes(params) / 2**30:.2f} | "
                        f"{ms['ar_step_ms']:.2f} | {ms['draft_step_ms']:.2f} | {ms['verify_step_ms']:.2f} | "
                        f"{ar_tps:.1f} | {s3d_tps:.1f} | {s3d_tps / ar_tps:.2f}x |")
            del params, draft, state
    table = "\n".join([
        "# PROJECTION: S3D on 7B-class shapes, from measured step times and measured acceptance",
        "",
        f"- device: {device.describe()}",
        f"- date: {datetime.date.today().isoformat()}",
        f"- step times: random bf16 weights (int8: quantized per channel), a {args.max_cache_len}-slot bf16 cache holding "
        f"{args.context} tokens, S3D skip plan: the middle L/2 - 1 layers, chain of gamma {gamma}; median of 3 runs of "
        f"{args.repeats} steps",
        f"- acceptance: tau {s3d['tau']:.2f} measured with SmolLM2's shipped draft on {s3d['prompts']} {args.dataset} "
        f"prompts ({args.acceptance}, {measured['device']})",
        "- projected S3D tokens/s = tau x 1000 / (draft ms + verify ms); AR tokens/s = 1000 / AR step ms. A 7B "
        "model's own draft would accept differently: this is a projection, not a measurement",
        "",
        "| shape | weights | parameter GiB | AR step ms | draft step ms | verify step ms | AR tokens/s | "
        "projected S3D tokens/s | projected speed-up |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *rows,
    ])
    report.write(args.out, "projection_7b", table)


if __name__ == "__main__":
    run(main)
