"""Give a draft its own vocabulary: the tokens the target emits most often, ranked on its own answers.

    python -m train.draft_vocab --data data/distill-smollm2 --size 8192 --draft IN.npz --out OUT.npz

The draft then scores only those rows of the shared LM head (SmolLM2's 49k-row head is a third of
an S3D draft's weights). Verification keeps the full head, so output is unchanged; a token outside
the vocabulary is simply never drafted. The ids and their coverage of the answer tokens go into the
draft file's metadata.
"""

from __future__ import annotations

import numpy as np

from infer.cli import Parser, run
from s3djax.errors import UserError
from train.shards import Shards


def rank_tokens(data: str, vocab_size: int) -> np.ndarray:
    """Token ids by how often they occur where the loss mask is on (the answers), most frequent first."""
    shards = Shards(data, "train")
    counts = np.bincount(shards.tokens[shards.loss_mask > 0], minlength=vocab_size)
    return np.argsort(-counts, kind="stable"), counts


def draft_vocab(data: str, size: int, vocab_size: int, eos_ids=()) -> tuple[list[int], float]:
    """(the `size` most frequent ids, EOS included, sorted; the share of answer tokens they cover)."""
    if not 1 <= size <= vocab_size:
        raise UserError(f"--size must be in 1..{vocab_size}, got {size}")
    order, counts = rank_tokens(data, vocab_size)
    chosen = set(int(i) for i in eos_ids)
    for i in order:
        if len(chosen) >= size:
            break
        chosen.add(int(i))
    ids = sorted(chosen)
    return ids, float(counts[ids].sum() / max(counts.sum(), 1))


def main(argv=None):
    from s3djax.speculative.draft_params import load_artifact, save_artifact

    p = Parser(prog="python -m train.draft_vocab", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="token shards (train.distill or train.prepare_data) to rank on")
    p.add_argument("--size", type=int, default=8192)
    p.add_argument("--draft", required=True, help="the draft file to extend")
    p.add_argument("--out", required=True)
    p.add_argument("--vocab-size", type=int, default=49152, help="the model's vocabulary size")
    p.add_argument("--eos", default="2", help="EOS ids always kept, comma-separated")
    args = p.parse_args(argv)
    tree, meta = load_artifact(args.draft, np.float32)
    ids, coverage = draft_vocab(args.data, args.size, args.vocab_size, [int(e) for e in args.eos.split(",") if e])
    save_artifact(args.out, tree, {**meta, "vocab": ids, "vocab_coverage": round(coverage, 4), "vocab_data": args.data})
    print(f"vocabulary of {len(ids)} tokens covers {coverage:.1%} of the answer tokens in {args.data} -> {args.out}")


if __name__ == "__main__":
    run(main)
