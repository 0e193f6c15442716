"""`python -m infer.generate`: stream a completion from a model, then print a stats line.

Text streams to stdout; progress and the stats line go to stderr. With --json, stdout ends with one
JSON object instead of the streamed text.
"""

from __future__ import annotations

import json
import sys

from s3djax import cli, quant
from s3djax.cli import Parser, run
from s3djax.methods import METHODS

DEFAULT_PROMPT = "Explain in three sentences why the sky is blue."


def add_model_flags(p: Parser) -> None:
    """The model, the method and its options, the cache and the sampling: the flags `infer.chat` shares."""
    p.add_argument("--model", default="smollm2-135m", help="registry name, .gguf file or checkpoint folder")
    p.add_argument("--checkpoint", help="checkpoint folder for a registry shape such as llama-2-7b")
    p.add_argument("--method", choices=METHODS, default="ar")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--max-cache-len", type=int, default=2048)
    p.add_argument("--quant", choices=quant.MODES,
                   help="int8 weights, quantized on load: weight-only, the layers' linears (int8) or those plus the "
                   "embedding and LM head (int8-all); or all of them with int8 activations too, an integer dot product "
                   "each (w8a8, as llama.cpp's Q8_0); default: as the checkpoint stores them")
    p.add_argument("--matmul", choices=("xla", "pallas"), default="xla",
                   help="int8 matmul: XLA's fused convert, or the Pallas kernel (interpret mode on CPU: slow)")
    p.add_argument("--attention", choices=("xla", "pallas"),
                   help="pallas: the tree-attention kernel for decode, draft and verify steps (interpret mode on CPU: "
                   "slow); default: pallas on a GPU, xla elsewhere")
    p.add_method_options()
    p.add_sampling()


def generator(args):
    """The Generator the model flags describe, its weights not yet read (so bad options fail first)."""
    from s3djax import methods
    from s3djax.generator import Generator

    return Generator(args.model, method=args.method, checkpoint=args.checkpoint, dtype=args.dtype,
                     max_cache_len=args.max_cache_len, quant=args.quant, matmul=args.matmul, attention=args.attention,
                     load=False, **methods.options(args, args.method))


def parse_args(argv=None):
    p = Parser(prog="python -m infer.generate", description=__doc__.splitlines()[0])
    source = p.add_mutually_exclusive_group()
    source.add_argument("--prompt", help="prompt text (default: --prompt-file, else stdin, else a built-in prompt)")
    source.add_argument("--prompt-file", help="read the prompt from this file")
    source.add_argument("--batch-file", help="decode every prompt of this file as one batch: a prompt a line, or JSON "
                        "lines each with a \"prompt\" string; prints each answer (with --json, a JSON object a line)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    add_model_flags(p)
    p.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
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


def read_batch(path: str) -> list[str]:
    """The prompts of a --batch-file: JSON lines ({"prompt": ...}) if every non-blank line is one, else a prompt a line."""
    from s3djax.errors import UserError

    try:
        with open(path) as f:
            lines = [line.rstrip("\n") for line in f if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read --batch-file: {getattr(e, 'strerror', None) or e}: {path}") from None
    if not lines:
        raise UserError(f"--batch-file {path} has no prompts")
    if all(line.lstrip().startswith("{") for line in lines):
        prompts = []
        for i, line in enumerate(lines, 1):
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"--batch-file {path} line {i}: not JSON ({e.msg})") from None
            if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
                raise UserError(f'--batch-file {path} line {i}: expected an object with a "prompt" string')
            prompts.append(item["prompt"])
        return prompts
    return lines


def main_batch(args):
    prompts = read_batch(args.batch_file)
    sampling = cli.sampling(args)
    gen = generator(args)
    for prompt in prompts:  # every prompt is checked before a weight is read
        gen.check(prompt, chat_template=not args.no_chat_template, sampling=sampling)
    print(f"decoding {len(prompts)} prompts...", file=sys.stderr, flush=True)
    outs = gen.generate(prompts, args.max_new_tokens, seed=args.seed, chat_template=not args.no_chat_template,
                        sampling=sampling)
    for i, out in enumerate(outs):
        print(json.dumps({"index": i, **out.json()}) if args.json else f"--- {i}\n{out.text}", flush=True)
    new = sum(len(o.token_ids) for o in outs)
    rate = outs[0].stats.get("batch_tokens_per_s", outs[0].tokens_per_s)
    how = outs[0].stats.get("batch_drafting")  # whether the batch drafted, and why (`defaults.batch_choice`)
    plain = f" ({how})" if how else ""
    print(f"[{args.method}] {len(outs)} prompts, {new} new tokens, one batch{plain}, {rate:.1f} tokens/s decode "
          f"over all rows; on {outs[0].device}", file=sys.stderr)


def main(argv=None):
    args = parse_args(argv)
    if args.batch_file:
        return main_batch(args)
    prompt = read_prompt(args)
    sampling = cli.sampling(args)
    gen = generator(args)
    ids = gen.check(prompt, chat_template=not args.no_chat_template, sampling=sampling)
    session = gen.session(sampling=sampling)
    for warning in session.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(f"loaded {gen.model.name} in {gen.model.load_s:.1f} s; compiling...", file=sys.stderr, flush=True)
    options = dict(seed=args.seed, chat_template=not args.no_chat_template, sampling=sampling)
    if args.json:
        out = gen.generate(prompt, args.max_new_tokens, **options)
    else:
        stream = gen.stream(prompt, args.max_new_tokens, **options)
        for piece in stream:
            sys.stdout.write(piece)
            sys.stdout.flush()
        print(flush=True)
        out = stream.output
    memory = f"params {out.param_bytes / 2**20:.0f} MiB ({out.quant})" + (
        f", peak {out.peak_device_bytes / 2**20:.0f} MiB" if out.peak_device_bytes else "")
    print(f"[{args.method}] prompt {out.prompt_tokens} tokens, {len(out.token_ids)} new tokens, "
          f"{out.tokens_per_s:.1f} tokens/s decode, time to first token {out.ttft_s * 1000:.0f} ms, "
          f"compile {out.compile_s:.1f} s (apart); {memory}; on {out.device}", file=sys.stderr)
    if out.stats:
        print(f"[{args.method}] tau {out.tau:.2f} tokens per verify step (bonus included), "
              f"acceptance by depth {' '.join(f'{a:.2f}' for a in out.acceptance_by_depth)}, "
              f"{out.stats['verify_steps']} verify steps, {out.stats['mean_drafted']:.2f} drafted per step, "
              f"{out.stats['paused_steps']} paused; "
              f"{session.about}", file=sys.stderr)
    if args.profile and out.stats:
        from s3djax.speculative.profile import step_times

        state = session.runner.prefill(ids)  # reuses the compiled prefill
        out.stats.update({k: round(v, 2) for k, v in step_times(session.built.decoder, session.built.params,
                                                                  state).items()})
        print(f"[{args.method}] step times at the prompt's length: " + ", ".join(
            f"{k.removesuffix('_ms').replace('_', ' ')} {v:.1f} ms" for k, v in out.stats.items()
            if k.endswith("_ms")), file=sys.stderr)
    if args.json:
        print(json.dumps(out.json()))


if __name__ == "__main__":
    run(main)
