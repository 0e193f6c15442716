"""Greedy decode speed of s3djax against transformers' PyTorch `generate`, in one process.

Same model weights (SmolLM2 from its GGUF, loaded once and handed to both), same prompt, same number
of new tokens (EOS ignored so both run the full budget), same device. Runs are interleaved so drift
hits both sides. Writes a Markdown table under benchmarks/results/ naming the device and versions.

    python -m benchmarks.decode_vs_transformers [--new-tokens 128] [--rounds 3]
"""

from __future__ import annotations

import datetime
import os
import statistics
import sys
import time

from benchmarks import report
from s3djax.cli import Parser, run

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def main():
    p = Parser(prog="python -m benchmarks.decode_vs_transformers", description=__doc__.splitlines()[0])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cache-lens", default="512,2048", help="s3djax cache lengths to measure")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()

    import jax
    import torch
    import transformers

    from s3djax import device, weights
    from s3djax.decode import ARDecoder, Runner
    from s3djax.loading import load_model
    from s3djax.tokenizer import encode_prompt

    m = load_model("smollm2-135m")
    print(f"loaded {m.name} in {m.load_s:.1f} s", file=sys.stderr)
    ids = encode_prompt(m.tokenizer, PROMPT, chat_template=True)
    n = args.new_tokens

    torch.set_num_threads(os.cpu_count())
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**m.config.to_hf())).eval()
    hf.load_state_dict({k: torch.tensor(v) for k, v in weights.to_hf_tensors(m.params, m.config).items()},
                       strict=False)
    hf.tie_weights()
    prompt = torch.tensor([ids])

    def run_hf():
        t = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=2)
        return out[0, len(ids):].tolist(), time.perf_counter() - t

    runners = {c: Runner(ARDecoder(m.config, c, eos_ids=()), m.params) for c in map(int, args.cache_lens.split(","))}
    compile_s = {c: r.generate(ids, 2).compile_s for c, r in runners.items()}  # compile + warm-up
    run_hf()
    hf_times, ours = [], {c: [] for c in runners}
    hf_tokens = our_tokens = None
    for _ in range(args.rounds):
        hf_tokens, s = run_hf()
        hf_times.append(s)
        for c, r in runners.items():
            res = r.generate(ids, n)
            ours[c].append(res)
            our_tokens = res.tokens
    identical = hf_tokens == our_tokens
    hf_tps = n / statistics.median(hf_times)
    dev = device.describe()
    rows = [f"| transformers {transformers.__version__} generate (torch {torch.__version__}) | dynamic | "
            f"{hf_tps:.1f} | 1.00x | - | - |"]
    for c, results in ours.items():
        total = statistics.median(r.ttft_s + r.decode_s for r in results)
        decode = statistics.median(r.tokens_per_s for r in results)
        rows.append(f"| s3djax AR (one while_loop) | {c} | {n / total:.1f} | {n / total / hf_tps:.2f}x | "
                    f"{decode:.1f} | {compile_s[c]:.1f} |")
    table = "\n".join([
        "# Greedy decode: s3djax vs transformers, SmolLM2-135M-Instruct fp32",
        "",
        f"- device: {dev}",
        f"- jax {jax.__version__}, transformers {transformers.__version__}, torch {torch.__version__}",
        f"- date: {datetime.date.today().isoformat()}",
        f"- prompt: {len(ids)} tokens (chat template); {n} new tokens, EOS ignored; median of {args.rounds} interleaved rounds",
        f"- SmolLM2 load (GGUF parse, dequantize, tokenizer): {m.load_s:.1f} s",
        f"- greedy tokens identical between the two: {identical}",
        "",
        "| engine | cache length | tokens/s (end to end) | vs transformers | tokens/s (decode only) | compile s |",
        "| --- | --- | --- | --- | --- | --- |",
        *rows,
        "",
        "End to end = new tokens / (prefill + decode) wall time, compile excluded; decode only excludes prefill.",
    ])
    report.write(args.out, "decode_vs_transformers", table)

if __name__ == "__main__":
    run(main)
