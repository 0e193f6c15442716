"""The decode step with bf16 weights against int8 weights, in two regimes, one process.

SmolLM2-135M (its real weights), where a step is small enough to be bound by launches and
attention as much as by weights; and the Llama-2-7B shape with random weights, where a decode step
is bound by reading the weights. For each: fastest step time, achieved weight bandwidth against a
measured device copy, parameter bytes and device memory in use.

    python -m benchmarks.int8_decode [--quick] [--context 512] [--max-cache-len 1024]

On CPU (`--quick`), the 7B shape is replaced by a 1/16-width, 2-layer stand-in and the Pallas kernel runs
in interpret mode: the table then checks the script, not the speed.
"""

from __future__ import annotations

import datetime
import gc
import sys

from benchmarks import report
from s3djax.cli import Parser, run


def main():
    p = Parser(prog="python -m benchmarks.int8_decode", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small shapes: a CPU check of the script")
    p.add_argument("--model", default="smollm2-135m", help="the small regime's model: registry name, .gguf or folder")
    p.add_argument("--checkpoint", help="its file, where the registry's package is not installed")
    p.add_argument("--context", type=int, default=512, help="committed tokens in the cache")
    p.add_argument("--max-cache-len", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()

    import jax
    import jax.numpy as jnp

    from s3djax import cache as kv
    from s3djax import device, model, quant, registry
    from s3djax.loading import load_model
    from s3djax.speculative.profile import ms_per_step

    bf16 = jnp.bfloat16
    small = load_model(args.model, checkpoint=args.checkpoint, dtype="bfloat16", progress=False)
    big = registry.lookup("llama-2-7b").config()
    if args.quick:
        big = big.replace(num_layers=2, hidden_size=256, intermediate_size=688, num_heads=2, num_kv_heads=2)
    regimes = {f"{small.name} (real weights)": (small.config, lambda: small.params),
               f"Llama-2-7B shape{' (1/16-width, 2-layer stand-in)' if args.quick else ''}, random weights":
                   (big, lambda: model.random_params(big, jax.random.key(0), bf16))}
    variants = {"bf16": None, "int8 (XLA)": ("int8", "xla"), "int8 (Pallas)": ("int8", "pallas"),
                "int8-all (XLA)": ("int8-all", "xla")}

    def step_ms(config, params, cache, length):
        """One decode step carried through a loop with the cache in place, as the decode loop runs it."""
        def step(params, cache):
            token = jnp.ones((1, 1), jnp.int32)
            decoder, variables = model.Decoder(config), {"params": params}
            hidden, cache = decoder.apply(variables, token, length[:, None], cache, length, kv.causal(length, 1))
            return cache, jnp.argmax(decoder.apply(variables, hidden, method="logits"), -1).astype(jnp.int32)
        return ms_per_step(step, params, cache, args.repeats)[0]

    def weight_bytes(params, config):
        # What a step reads: every layer weight and the head; of an untied embedding, one row.
        read = quant.param_bytes(params)
        return read - quant.param_bytes(params["embed"]) if not config.tie_word_embeddings else read

    copy_bw = report.copy_bandwidth(args.repeats)
    rows = []
    for regime, (config, make) in regimes.items():
        base_ms = None
        for name, how in variants.items():
            params = make()
            if how:
                params = quant.apply(params, how[0], bf16, how[1])
            cache = kv.init_cache(config, 1, args.max_cache_len, bf16)
            length = jnp.full((1,), args.context, jnp.int32)
            print(f"{regime}: {name}...", file=sys.stderr, flush=True)
            ms = step_ms(config, params, cache, length)
            base_ms = base_ms or ms
            in_use = device.memory_bytes("bytes_in_use")
            rows.append(f"| {regime} | {name} | {ms:.3f} | {base_ms / ms:.2f}x | "
                        f"{weight_bytes(params, config) / ms / 1e6:.1f} | "
                        f"{weight_bytes(params, config) / ms / 1e6 / (copy_bw / 1e9):.0%} | "
                        f"{quant.param_bytes(params) / 2**30:.3f} | "
                        f"{'-' if in_use is None else f'{in_use / 2**30:.2f}'} |")
            del params, cache
            gc.collect()
    peak = device.memory_bytes("peak_bytes_in_use")
    table = "\n".join([
        "# Decode step: bf16 against int8 weights",
        "",
        f"- device: {device.describe()}",
        f"- date: {datetime.date.today().isoformat()}",
        f"- measured copy bandwidth: {copy_bw / 1e9:.1f} GB/s; process peak device memory: "
        f"{'-' if peak is None else f'{peak / 2**30:.2f} GiB'}",
        f"- one token per step over a {args.max_cache_len}-slot bf16 cache holding {args.context} tokens; activations "
        f"bf16; each step run {args.repeats} times in a loop carrying the cache in place, fastest of 3 such runs",
        "- weight GB/s: the bytes of weights a step reads (layers and LM head) per step time; the KV cache read is "
        "extra",
        "- int8: the layers' linears; int8-all: also the embedding and LM head",
        "",
        "| model | weights | step ms | speed vs bf16 | weight GB/s | of copy bandwidth | parameter GiB | device GiB in use |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        *rows,
    ])
    report.write(args.out, "int8_decode", table)


if __name__ == "__main__":
    run(main)
