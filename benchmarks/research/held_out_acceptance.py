"""What the training metric predicts for S3D against what the engine gets, on held-out self-distilled answers.

    python -m benchmarks.research.held_out_acceptance [--data train/distilled/smollm2-sharegpt-10k] [--rows 40] [--tokens 128]

Three numbers per setting, on the prompts of the first N held-out rows:
- agreement by depth: training's held-out metric (draft argmax == the answer's token, teacher-forced), over
  the first `--tokens` answer tokens and over the rest;
- simulated tau: a chain decoded from that teacher-forced correctness, anchor by anchor; exact for a chain,
  whose depth k is drafted only when the depths before it were right, so its correction sees the true token;
- engine tau: s3d itself (the chain, no prompt lookup) on the same prompts, its output checked against the
  answers (the target's own greedy tokens).
The draft's own vocabulary is left out of the first two (training scores the full head).
"""

from __future__ import annotations

import datetime

import numpy as np

from benchmarks import report
from s3djax.cli import Parser, run

CHUNK = 64  # anchors per forward, so every row compiles to one shape


def chain_steps(correct, gamma: int, limit: int) -> list[int]:
    """Drafts accepted at each step of a chain decoded from per-anchor correctness [A, >= gamma], over the
    first `limit` anchors (the step's first draft is answer token p + 1 for anchor p)."""
    steps, p = [], 0
    while p < min(limit, len(correct)):
        k = 0
        while k < gamma and correct[p, k]:
            k += 1
        steps.append(k)
        p += k + 1
    return steps


def main():
    p = Parser(prog="python -m benchmarks.research.held_out_acceptance", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="train/distilled/smollm2-sharegpt-10k", help="a distilled set with eval shards")
    p.add_argument("--draft", help="draft file (default: the model's shipped draft)")
    p.add_argument("--rows", type=int, default=40, help="the first N held-out rows")
    p.add_argument("--tokens", type=int, default=128, help="new tokens per prompt (the engine's and the split's)")
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    p.check(args, rows=args.rows >= 1, tokens=args.tokens >= 2, gamma=args.gamma >= 1)

    import jax
    import jax.numpy as jnp

    from s3djax import device, methods
    from s3djax.decode import Runner
    from s3djax.loading import load_model
    from s3djax.model import forward_sequence
    from s3djax.progress import bar
    from s3djax.speculative.loop import acceptance
    from train.objectives import block_logits
    from train.shards import Shards

    held_out = Shards(args.data, "eval")
    m = load_model("smollm2-135m", progress=False)
    built = methods.build("s3d", m, max_cache_len=1024, gamma=args.gamma, tree="chain", lookup=0,
                          draft_path=args.draft)
    params, draft = built.params
    plan, gamma = built.decoder.drafter.plan, args.gamma
    full_head = {k: v for k, v in draft.items() if k not in ("head", "vocab")}
    engine = Runner(built.decoder, built.params)

    # The row's context once, then its anchors chunk by chunk.
    row_context = jax.jit(lambda tokens: forward_sequence(params, tokens, config=m.config)[1])

    @jax.jit
    def correct(tokens, context, anchors):
        logits = block_logits(params, full_head, context, tokens, anchors, config=m.config, plan=plan, gamma=gamma)
        at = jnp.minimum(anchors[:, :, None] + jnp.arange(1, gamma + 1), tokens.shape[1] - 1)
        return jnp.argmax(logits, -1) == jnp.take_along_axis(tokens, at.reshape(1, -1), 1).reshape(at.shape)

    rows, early, late, simulated, accepted, same = 0, [], [], {g: [] for g in range(1, gamma + 1)}, [], 0
    for r in bar(range(min(args.rows, len(held_out))), desc="held-out rows", unit="row"):
        length = int(held_out.lengths[r])
        answer = np.nonzero(held_out.loss_mask[r][:length])[0]
        start, end = answer[0] - 1, length - 1 - gamma  # anchor p drafts p+1 .. p+gamma, all inside the row
        if end - start < 16:
            continue
        anchors = np.arange(start, end)
        padded = np.concatenate([anchors, np.full(-len(anchors) % CHUNK, anchors[-1])])
        tokens = jnp.asarray(held_out.tokens[r:r + 1])
        context = row_context(tokens)
        c = np.concatenate([np.asarray(correct(tokens, context, jnp.asarray(padded[None, i:i + CHUNK])))[0]
                            for i in range(0, len(padded), CHUNK)])[:len(anchors)]
        early.append(c[:args.tokens - 1])
        late.append(c[args.tokens - 1:])
        for g in simulated:
            simulated[g] += chain_steps(c, g, args.tokens - 1)
        out = engine.generate(held_out.tokens[r, :answer[0]].tolist(), args.tokens)
        same += out.tokens == held_out.tokens[r, answer[0]:answer[0] + len(out.tokens)].tolist()
        accepted += out.stats["accepted_per_step"]
        rows += 1
    if not rows:
        p.error(f"none of the first {args.rows} held-out rows has an answer of 16+ tokens")

    depths = lambda parts: " / ".join(f"{a:.3f}" for a in np.concatenate(parts).mean(0)) if sum(map(len, parts)) else "-"
    alphas = lambda got: " / ".join(f"{a:.2f}" for a in got["acceptance_by_depth"])
    lines = ["# S3D on held-out self-distilled answers: the training metric against the engine", "",
             f"- device: {device.describe()}", f"- date: {datetime.date.today().isoformat()}",
             f"- {rows} held-out rows of {args.data} (the first {args.rows}; rows with answers under 16 tokens "
             f"left out), their prompts as given; s3d: {built.draft}",
             f"- engine: s3d, chain, gamma {gamma}, no prompt lookup, {args.tokens} new tokens; its output "
             f"matched the row's answer in {same}/{rows} rows", "",
             "| measure | value |", "| --- | --- |",
             f"| agreement by depth, answer tokens 1-{args.tokens - 1} | {depths(early)} |",
             f"| agreement by depth, answer tokens {args.tokens} on | {depths(late)} |"]
    for g, steps in simulated.items():
        got = acceptance(steps, g)
        lines.append(f"| simulated chain, gamma {g}: tau (alpha by depth) | {got['mean_accepted_tokens']:.2f} "
                     f"({alphas(got)}) |")
    got = acceptance(accepted, gamma)
    lines.append(f"| engine, gamma {gamma}: tau (alpha by depth) | {got['mean_accepted_tokens']:.2f} ({alphas(got)}) |")
    report.write(args.out, "held_out_acceptance", "\n".join(lines))


if __name__ == "__main__":
    run(main)
