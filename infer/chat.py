"""`python -m infer.chat`: talk to a model in turns; each turn continues the conversation's cache.

Type a message and press Enter (from a terminal, or one message a line from stdin); the answer streams. Commands:
/reset forgets the conversation, /stats prints the last turn's statistics, /quit (or end of input) leaves.
"""

from __future__ import annotations

import sys

from infer.generate import add_model_flags, generator
from s3djax import cli
from s3djax.cli import Parser, run
from s3djax.errors import UserError
from s3djax.generator import OVERFLOWS

COMMANDS = ("/reset", "/stats", "/quit")


def parse_args(argv=None):
    p = Parser(prog="python -m infer.chat", description=__doc__.splitlines()[0])
    add_model_flags(p)
    p.add_argument("--max-new-tokens", type=int, default=256, help="the most tokens an answer takes")
    p.add_argument("--system", help="a system message opening the conversation (default: the chat template's)")
    p.add_argument("--overflow", choices=OVERFLOWS, default="stop",
                   help="when the conversation outgrows --max-cache-len: stop (say so; /reset goes on) or slide "
                   "(drop the oldest exchanges)")
    args = p.parse_args(argv)
    p.check(args, max_new_tokens=args.max_new_tokens >= 1, max_cache_len=args.max_cache_len >= 2)
    return args


def stats_line(method: str, out, chat) -> str:
    s = out.stats
    line = (f"[{method}] prompt {out.prompt_tokens} tokens ({s.get('reused_tokens', 0)} from the cache), "
            f"{len(out.token_ids)} new, {out.tokens_per_s:.1f} tokens/s, time to first token {out.ttft_s * 1000:.0f} ms; "
            f"conversation {chat.cached_tokens} tokens cached of {chat.session.runner.decoder.max_cache_len}")
    if out.tau is not None:
        line += f"; tau {out.tau:.2f}"
    return line + ("; the cache is full: /reset" if s.get("cache_full") else "")


def main(argv=None):
    args = parse_args(argv)
    gen = generator(args)
    chat = gen.chat(sampling=cli.sampling(args), system=args.system, overflow=args.overflow)
    for warning in chat.session.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    interactive = sys.stdin.isatty()
    print(f"loaded {gen.model.name}; {', '.join(COMMANDS)}", file=sys.stderr, flush=True)
    last, turn = None, 0
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "/quit":
            return
        text = line.strip()
        if not text:
            continue
        if text == "/reset":
            chat.reset()
            print("(conversation forgotten)", file=sys.stderr, flush=True)
            continue
        if text == "/stats":
            print(stats_line(args.method, last, chat) if last else "(no turn yet)", file=sys.stderr, flush=True)
            continue
        try:
            if text.startswith("/"):
                raise UserError(f"unknown command {text.split()[0]}; the commands are {', '.join(COMMANDS)}")
            stream = chat.stream(text, args.max_new_tokens, seed=args.seed + turn)
        except UserError as e:
            if not interactive:  # a script's bad line ends the run: one line, exit 2
                raise
            print(f"error: {e}", file=sys.stderr, flush=True)
            continue
        for piece in stream:
            sys.stdout.write(piece)
            sys.stdout.flush()
        print(flush=True)
        last, turn = stream.output, turn + 1
        if last.stats.get("cache_full"):
            print("(the cache is full: /reset to go on)", file=sys.stderr, flush=True)


if __name__ == "__main__":
    run(main)
