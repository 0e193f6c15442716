"""Give a draft its own vocabulary: the tokens the target emits most often, ranked on its own answers.

    python -m train.draft_vocab --data data/distill-smollm2 --size 8192 --draft IN.npz --out OUT.npz
    (or --draft PLAN.yaml --out PLAN.yaml: a Self-Spec plan)

The draft then scores only those rows of the shared LM head (SmolLM2's 49k-row head is a third of
an S3D draft's weights). Verification keeps the full head, so output is unchanged; a token outside
the vocabulary is simply never drafted. Tokens are ranked by their count in the answers of --data's
train split; ties (a small corpus leaves most of the vocabulary at zero) are broken by the count in
ShareGPT's own assistant turns. The ids and their coverage of --data's held-out answers go into the
draft file's metadata.
"""

from __future__ import annotations

import numpy as np

from s3djax.cli import Parser, run
from s3djax.errors import UserError
from train.shards import Shards


def answer_counts(data: str, split: str, vocab_size: int) -> np.ndarray:
    """How often each token occurs where the loss mask is on (the answers)."""
    shards = Shards(data, split)
    return np.bincount(shards.tokens[shards.loss_mask > 0], minlength=vocab_size)


def sharegpt_counts(tokenizer, vocab_size: int, conversations: int) -> np.ndarray:
    """Token counts over the assistant turns of the first ShareGPT conversations (the tie-breaker)."""
    import collections

    from s3djax.sharegpt import clean_turns, read_records, sharegpt_path

    texts = [m["content"] for r in read_records(sharegpt_path(), conversations)[0]
             for m in clean_turns(r.get("conversations") if isinstance(r, dict) else None, collections.Counter())
             if m["role"] == "assistant"]
    ids = [i for enc in tokenizer(texts, add_special_tokens=False)["input_ids"] for i in enc]
    return np.bincount(np.asarray(ids, np.int64), minlength=vocab_size)[:vocab_size]


def draft_vocab(counts: np.ndarray, size: int, tie_break=None, eos_ids=()) -> list[int]:
    """The `size` most frequent ids by `counts` (then `tie_break`), EOS included, sorted."""
    if not 1 <= size <= len(counts):
        raise UserError(f"--size must be in 1..{len(counts)}, got {size}")
    tie_break = np.zeros_like(counts) if tie_break is None else tie_break
    order = np.lexsort((-tie_break, -counts))  # the last key sorts first
    chosen = set(int(i) for i in eos_ids)
    for i in order:
        if len(chosen) >= size:
            break
        chosen.add(int(i))
    return sorted(chosen)


def main(argv=None):
    from s3djax.speculative.draft_params import load_artifact, save_artifact
    from s3djax.speculative.drafters.self_spec import load_plan, save_plan

    p = Parser(prog="python -m train.draft_vocab", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="token shards (train.distill or train.prepare_data) to rank on")
    p.add_argument("--size", type=int, default=8192)
    p.add_argument("--draft", required=True, help="the draft file to extend (.npz, or a Self-Spec plan .yaml)")
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="smollm2-135m", help="its tokenizer and EOS ids")
    p.add_argument("--sharegpt", type=int, default=3000, help="ShareGPT conversations whose counts break ties")
    args = p.parse_args(argv)
    from s3djax.loading import load_tokenizer, open_model

    tokenizer = load_tokenizer(args.model)
    vocab_size = len(tokenizer)
    ids = draft_vocab(answer_counts(args.data, "train", vocab_size), args.size,
                      sharegpt_counts(tokenizer, vocab_size, args.sharegpt), [tokenizer.eos_token_id])
    held_out = answer_counts(args.data, "eval", vocab_size)
    coverage = float(held_out[ids].sum() / max(held_out.sum(), 1))
    extra = {"vocab": ids, "vocab_coverage": round(coverage, 4), "vocab_data": args.data}
    if args.draft.endswith((".yaml", ".yml")):  # a Self-Spec plan: its draft is the target's own weights
        plan, record = load_plan(args.draft, open_model(args.model).config.num_layers)
        save_plan(args.out, plan, {**{k: v for k, v in record.items() if k not in ("skip", "num_layers")}, **extra})
    else:
        tree, meta = load_artifact(args.draft, np.float32)
        save_artifact(args.out, tree, {**meta, **extra})
    print(f"vocabulary of {len(ids)} tokens covers {coverage:.1%} of the held-out answer tokens in {args.data} "
          f"-> {args.out}")


if __name__ == "__main__":
    run(main)
