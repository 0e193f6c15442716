"""`python -m infer.generate`: stream a completion from a model, then print a stats line.

Text streams to stdout; progress and the stats line go to stderr. With --json, stdout ends with one
JSON object instead of the streamed text.
"""

from __future__ import annotations

import json
import sys

from infer.cli import Parser, run, sampling
from s3djax.methods import METHODS

DEFAULT_PROMPT = "Explain in three sentences why the sky is blue."


def parse_args(argv=None):
    p = Parser(prog="python -m infer.generate", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="registry name, .gguf file or checkpoint folder")
    p.add_argument("--checkpoint", help="checkpoint folder for a registry shape such as llama-2-7b")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--prompt", help="prompt text (default: --prompt-file, else stdin, else a built-in prompt)")
    source.add_argument("--prompt-file", help="read the prompt from this file")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--method", choices=METHODS, default="ar")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--max-cache-len", type=int, default=2048)
    p.add_argument("--quant", choices=("none", "int8", "int8-all"),
                   help="weight-only int8: the layers' linears (int8) or those plus embedding and LM head "
                   "(int8-all), quantized on load; default: as the checkpoint stores them")
    p.add_argument("--matmul", choices=("xla", "pallas"), default="xla",
                   help="int8 matmul: XLA's fused convert, or the Pallas kernel (interpret mode on CPU: slow)")
    p.add_argument("--attention", choices=("xla", "pallas"), default="xla",
                   help="pallas: the tree-attention kernel for decode, draft and verify steps (interpret mode on CPU: slow)")
    p.add_method_options()
    p.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    p.add_sampling()
    p.add_argument("--json", action="store_true", help="end stdout with one JSON object instead of streaming")
    p.add_argument("--profile", action="store_true",
                   help="speculative methods: also time the draft and verify steps apart (after the run)")
    args = p.parse_args(argv)
    p.check(args, max_new_tokens=args.max_new_tokens >= 1, max_cache_len=args.max_cache_len >= 2)
    return args


def read_prompt(args) -> str:
    from s3djax.errors import UserError

    if args.prompt is not None:
        return args.prompt
    if args.prompt_file:
        try:
            with open(args.prompt_file) as f:
                return f.read()
        except OSError as e:
            raise UserError(f"cannot read --prompt-file: {e.strerror}: {args.prompt_file}") from None
    if not sys.stdin.isatty():
        text = sys.stdin.read()
        if text.strip():
            return text
    return DEFAULT_PROMPT


class TextStream:
    """Prints the new suffix of the decoded text, holding back an incomplete UTF-8 character."""

    def __init__(self, tokenizer, out=sys.stdout):
        self.tokenizer, self.out, self.printed = tokenizer, out, 0

    def __call__(self, tokens):
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return
        self.out.write(text[self.printed:])
        self.out.flush()
        self.printed = len(text)


def main(argv=None):
    args = parse_args(argv)
    prompt = read_prompt(args)
    from s3djax import device, methods, quant
    from s3djax.decode import Runner
    from s3djax.loading import load_model
    from s3djax.tokenizer import encode_prompt

    m = load_model(args.model, dtype=args.dtype, checkpoint=args.checkpoint, attention=args.attention,
                   quantization=args.quant, matmul=args.matmul)
    built = methods.build(args.method, m, max_cache_len=args.max_cache_len, dtype=args.dtype,
                          sampling=sampling(args), **methods.options(args, args.method))
    for warning in built.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    tok = m.tokenizer
    ids = encode_prompt(tok, prompt, chat_template=not args.no_chat_template)
    built.decoder.check_prompt(len(ids))
    print(f"loaded {m.name} in {m.load_s:.1f} s; compiling...", file=sys.stderr, flush=True)
    stream = None if args.json else TextStream(tok)
    runner = Runner(built.decoder, built.params)
    result = runner.generate(ids, args.max_new_tokens, seed=args.seed, on_tokens=stream)
    text = tok.decode(result.tokens, skip_special_tokens=True)
    if stream:
        print(flush=True)
    dev, param_bytes = device.describe(), quant.param_bytes(built.params)
    peak = device.memory_bytes("peak_bytes_in_use")
    memory = f"params {param_bytes / 2**20:.0f} MiB ({m.quant})" + (f", peak {peak / 2**20:.0f} MiB" if peak else "")
    print(f"[{args.method}] prompt {result.prompt_tokens} tokens, {len(result.tokens)} new tokens, "
          f"{result.tokens_per_s:.1f} tokens/s decode, time to first token {result.ttft_s * 1000:.0f} ms, "
          f"compile {result.compile_s:.1f} s (apart); {memory}; on {dev}", file=sys.stderr)
    if result.stats:
        st = result.stats
        print(f"[{args.method}] tau {st['mean_accepted_tokens']:.2f} tokens per verify step (bonus included), "
              f"acceptance by depth {' '.join(f'{a:.2f}' for a in st['acceptance_by_depth'])}, "
              f"{st['verify_steps']} verify steps, {st['mean_drafted']:.2f} drafted per step; {built.draft}",
              file=sys.stderr)
    if args.profile and result.stats:
        from s3djax.speculative.profile import step_times

        state = runner.prefill(ids)  # reuses the compiled prefill
        result.stats.update({k: round(v, 2) for k, v in step_times(built.decoder, built.params, state).items()})
        print(f"[{args.method}] step times at the prompt's length: " + ", ".join(
            f"{k.removesuffix('_ms').replace('_', ' ')} {v:.1f} ms" for k, v in result.stats.items()
            if k.endswith("_ms")), file=sys.stderr)
    if args.json:
        print(json.dumps(dict(text=text, prompt_tokens=result.prompt_tokens, new_tokens=len(result.tokens),
                              tokens_per_s=round(result.tokens_per_s, 3), ttft_s=round(result.ttft_s, 4),
                              compile_s=round(result.compile_s, 3), device=dev, method=args.method,
                              quant=m.quant, param_bytes=param_bytes, peak_device_bytes=peak, **result.stats)))


if __name__ == "__main__":
    run(main)
