"""What int8 weights cost in quality: greedy next-token agreement with the original weights, and perplexity.

Teacher-forced, so every position is scored on the same context: MT-Bench first turns (rendered
with the chat template, every prompt position), and held-out ShareGPT rows from `train.prepare_data`
(assistant tokens only), where perplexity is against the real next token. bf16 is shown beside the
int8 modes as the precision everyone already accepts.

    python -m benchmarks.research.int8_quality --data data/sharegpt-smollm2-256 [--rows 64]
"""

from __future__ import annotations

import datetime

from benchmarks import report
from s3djax.cli import Parser, run


def main():
    p = Parser(prog="python -m benchmarks.research.int8_quality", description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="token shards from train.prepare_data (its eval split is used)")
    p.add_argument("--rows", type=int, default=64, help="held-out rows to score")
    p.add_argument("--prompts", type=int, default=80, help="MT-Bench first turns to score")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from s3djax.progress import bar

    from s3djax import device, model, quant
    from s3djax.bench_data import mt_bench
    from s3djax.loading import load_model
    from s3djax.tokenizer import encode_prompt
    from train.shards import Shards

    m = load_model("smollm2-135m")
    eval_rows = Shards(args.data, "eval").rows(slice(0, args.rows))
    prompts = [encode_prompt(m.tokenizer, q["turns"][0], chat_template=True) for q in mt_bench()[:args.prompts]]

    @jax.jit
    def score(params, tokens):
        """Per-position argmax and log-probabilities [B, T, V] of a teacher-forced forward."""
        hidden, _ = model.forward_sequence(params, tokens, config=m.config, cache_dtype=jnp.float32)
        logp = jax.nn.log_softmax(model.Decoder(m.config).apply({"params": params}, hidden, method="logits"), axis=-1)
        return logp.argmax(-1), jnp.take_along_axis(logp[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]

    # Prompts padded at the end to one length (causal: padding never reaches a real position), so
    # each variant compiles twice, not once per prompt length.
    width = max(map(len, prompts))
    padded = np.zeros((len(prompts), width), np.int32)
    for i, ids in enumerate(prompts):
        padded[i, :len(ids)] = ids

    def batched(params, tokens):
        out = [score(params, jnp.asarray(tokens[i:i + 8])) for i in range(0, len(tokens), 8)]
        return np.concatenate([np.asarray(a) for a, _ in out]), np.concatenate([np.asarray(lp) for _, lp in out])

    def run_all(params):
        """(argmaxes of each prompt, argmaxes of each row, next-token log-probs of each row)."""
        on_prompts = batched(params, padded)[0]
        return [a[:len(ids)] for a, ids in zip(on_prompts, prompts)], *batched(params, eval_rows["tokens"])

    variants = {"float32 (original)": m.params,
                "bfloat16": jax.tree.map(lambda a: a.astype(jnp.bfloat16), m.params),
                "int8": quant.apply(m.params, "int8", jnp.float32),
                "int8-all": quant.apply(m.params, "int8-all", jnp.float32),
                "w8a8": quant.apply(m.params, "w8a8", jnp.float32)}
    results = {name: run_all(params) for name, params in bar(variants.items(), desc="scoring")}
    mask = eval_rows["loss_mask"][:, 1:].astype(bool)  # position t predicts token t+1, scored where it is trained on
    base_prompts, base_rows, _ = results["float32 (original)"]
    fp32_bytes = quant.param_bytes(m.params)
    lines = []
    for name, (on_prompts, on_rows, logp) in results.items():
        prompt_agree = np.mean(np.concatenate([a == b for a, b in zip(on_prompts, base_prompts)]))
        row_agree = np.mean((on_rows[:, :-1] == base_rows[:, :-1])[mask])
        ppl = float(np.exp(-logp[mask].mean()))
        size = quant.param_bytes(variants[name])
        lines.append(f"| {name} | {size / 2**20:.0f} MiB | {size / fp32_bytes:.2f}x | {prompt_agree:.4f} | "
                     f"{row_agree:.4f} | {ppl:.3f} |")
    table = "\n".join([
        "# int8 weight quality, SmolLM2-135M-Instruct",
        "",
        f"- device: {device.describe()}",
        f"- date: {datetime.date.today().isoformat()}",
        f"- MT-Bench: first turns of {len(prompts)} questions, chat template, every position "
        f"({sum(map(len, prompts))} positions)",
        f"- ShareGPT held-out: {args.rows} rows of {eval_rows['tokens'].shape[1]} tokens from `{args.data}`, "
        f"assistant positions only ({int(mask.sum())} positions)",
        "- agreement: the variant's greedy next token equals the float32 model's, teacher-forced",
        "- int8: the layers' linears; int8-all: those plus the tied embedding / LM head; activations fp32; w8a8: "
        "int8-all's weights, every product's input quantized to int8 in blocks of 32 (XLA's integer dot)",
        "",
        "| weights | parameter bytes | vs float32 | agreement, MT-Bench | agreement, ShareGPT | perplexity, ShareGPT |",
        "| --- | --- | --- | --- | --- | --- |",
        *lines,
    ])
    report.write(args.out, "int8_quality", table)


if __name__ == "__main__":
    run(main)
