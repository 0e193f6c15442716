"""Self-distillation data: the target's own greedy answers to ShareGPT prompts, as token shards.

    python -m train.distill --out data/distill-smollm2 --prompts 3000 --new-tokens 160 [--sort part]

Each conversation's first user turn is rendered as at inference (chat template, system prompt
included) and answered greedily by the project's batched AR decoder. The loss mask covers the answer
only, so every depth's training target is exactly the token greedy verification will emit.
Answers are written part by part: a rerun skips finished parts, and manifest.json (the format
`train.shards.Shards` reads) is rewritten after each, so training can start on what exists.
The chosen prompts' ids are kept in prompts.npz, so a rerun (on a GPU machine, say, which has no
ShareGPT) answers the same prompts without reading ShareGPT again.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time
import zipfile

import numpy as np

from s3djax.cli import Parser, output_folder, run
from s3djax.errors import UserError
from s3djax.sharegpt import SHAREGPT_FILE, clean_turns, conversation_id, is_held_out, read_records, sharegpt_path
from train.prepare_data import write_split
from train.shards import FORMAT


def first_prompts(records):
    """(conversation id, first user turn) of each conversation that has one, in ShareGPT's order."""
    dropped = collections.Counter()
    for i, record in enumerate(records):
        messages = clean_turns(record.get("conversations") if isinstance(record, dict) else None, dropped)
        if messages and messages[0]["role"] == "user":
            yield conversation_id(record, i), messages[0]["content"]


def chosen_prompts(tokenizer, path: str, *, model: str, count: int, max_prompt: int) -> list[tuple[str, list[int]]]:
    """(id, prompt ids) of the first `count` ShareGPT first turns no longer than `max_prompt` tokens.

    The choice is a prefix of ShareGPT's order, so a saved choice of at least `count` prompts for the same
    model and limit serves as is; otherwise ShareGPT is read and the choice saved to `path`."""
    from s3djax import tokenizer as tk

    if os.path.exists(path):
        try:
            with np.load(path) as f:
                if str(f["model"]) == model and int(f["max_prompt"]) == max_prompt and len(f["ids"]) >= count:
                    return saved_prompts(f, count)
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
            raise UserError(f"{path} is not a saved prompt choice ({e}); delete it to choose again") from None
    items = []
    for cid, text in first_prompts(read_records(sharegpt_path())[0]):
        ids = tk.encode_prompt(tokenizer, text, chat_template=True)
        if len(ids) <= max_prompt:
            items.append((cid, ids))
        if len(items) == count:
            break
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = path[:-len(".npz")] + ".partial.npz"
    np.savez_compressed(partial, model=model, max_prompt=max_prompt, ids=np.array([cid for cid, _ in items]),
                        lengths=np.array([len(ids) for _, ids in items], np.int32),
                        tokens=np.concatenate([ids for _, ids in items]).astype(np.int32))
    os.replace(partial, path)
    return items


def saved_prompts(f, count: int | None = None) -> list[tuple[str, list[int]]]:
    """The first `count` (id, prompt ids) of an opened prompts.npz (all of them for None)."""
    lengths, tokens = f["lengths"][:count], f["tokens"]  # an npz member is read again at each access: once here
    return [(str(cid), tokens[end - n:end].astype(np.int32).tolist())
            for cid, n, end in zip(f["ids"][:count], lengths, np.cumsum(lengths))]


def parts(items: list[tuple[str, list[int]]], part_rows: int, sort: str) -> list[list[tuple[str, list[int]]]]:
    """The (id, prompt ids) of each resumable part, each part sorted by prompt length.

    Similar lengths then share a batch, so padding wastes little; the order is fixed, so parts are
    stable. sort="all" sorts every prompt first, which pads least but leaves the first parts only the
    shortest prompts; with "part", each part is a slice of ShareGPT's own order and spans its lengths.
    """
    by_length = lambda item: len(item[1])  # noqa: E731
    items = sorted(items, key=by_length) if sort == "all" else items
    return [sorted(items[s:s + part_rows], key=by_length) for s in range(0, len(items), part_rows)]


def answer(runner, batch: list[list[int]], new_tokens: int, pad_id: int):
    """Greedy answers [B, new_tokens] (pad after EOS) to right-padded prompts of one batch."""
    import jax
    import jax.numpy as jnp

    from s3djax.decode import bucket

    d = runner.decoder
    width = bucket(max(map(len, batch)), d.max_cache_len)
    prompt = np.full((len(batch), width), pad_id, np.int32)
    for r, ids in enumerate(batch):
        prompt[r, :len(ids)] = ids
    args = (jnp.asarray(prompt), jnp.asarray([len(ids) for ids in batch], jnp.int32), jax.random.key(0))
    state = runner._compiled("start", d.start, *args)[0](runner.params, *args)
    state = runner._compiled("decode", d.decode, state, jnp.int32(0))[0](runner.params, state, jnp.int32(new_tokens))
    return np.asarray(state["tokens"])[:, :new_tokens]


def distill(model: str, out: str, *, prompts: int, new_tokens: int, max_prompt: int, batch_size: int,
            part_rows: int, eval_fraction: float, sort: str = "all", dtype: str = "float32",
            checkpoint: str | None = None) -> dict:
    from s3djax import quant
    from s3djax.decode import ARDecoder, Runner
    from s3djax.loading import load_model

    for name, ok in (("--prompts", prompts >= 1), ("--new-tokens", new_tokens >= 1), ("--max-prompt", max_prompt >= 8),
                     ("--batch-size", batch_size >= 1), ("--part-rows", part_rows >= batch_size)):
        if not ok:
            raise UserError(f"argument {name}: invalid value")
    m = load_model(model, dtype=dtype, checkpoint=checkpoint, progress=False)
    pad_id = m.tokenizer.pad_token_id if m.tokenizer.pad_token_id is not None else 0
    items = chosen_prompts(m.tokenizer, os.path.join(out, "prompts.npz"), model=model, count=prompts,
                           max_prompt=max_prompt)
    max_len = max_prompt + new_tokens
    decoder = ARDecoder(m.config, max_len, m.eos_ids, pad_id=pad_id)
    runner = Runner(decoder, quant.pack_for_cpu(m.params))  # packed: 16 rows 2.3x faster on a 2-core Zen 3
    os.makedirs(out, exist_ok=True)
    rows = {"train": [], "eval": []}
    t0, done = time.perf_counter(), 0
    for part, chunk in enumerate(parts(items, part_rows, sort)):
        path = os.path.join(out, f"part-{part:05d}.npz")
        if not os.path.exists(path) or part_size(path) != len(chunk):  # a short last part of a smaller --prompts
            tokens = np.full((len(chunk), max_len), pad_id, np.int32)
            masks = np.zeros((len(chunk), max_len), np.uint8)
            lengths = np.zeros(len(chunk), np.int32)
            for b in range(0, len(chunk), batch_size):
                batch = chunk[b:b + batch_size]
                answers = answer(runner, [ids for _, ids in batch], new_tokens, pad_id)
                for r, ((_, ids), ans) in enumerate(zip(batch, answers), start=b):
                    n = int(np.argmax(np.isin(ans, m.eos_ids))) + 1 if np.isin(ans, m.eos_ids).any() else new_tokens
                    tokens[r, :len(ids)], tokens[r, len(ids):len(ids) + n] = ids, ans[:n]
                    masks[r, len(ids):len(ids) + n] = 1
                    lengths[r] = len(ids) + n
            held = np.array([is_held_out(cid, eval_fraction) for cid, _ in chunk], bool)
            # Parts are the kept artifact (committed), so they are stored small: uint16 ids where the vocabulary fits.
            partial = path[:-len(".npz")] + ".partial.npz"  # renamed when whole, so a killed job never leaves half a part
            np.savez_compressed(partial, tokens=tokens.astype(np.uint16 if len(m.tokenizer) <= 1 << 16 else np.int32),
                                loss_mask=masks, lengths=lengths, held_out=held)
            os.replace(partial, path)
        with np.load(path) as f:
            for split, sel in (("train", ~f["held_out"]), ("eval", f["held_out"])):
                rows[split].append((f["tokens"][sel].astype(np.int32), f["loss_mask"][sel], f["lengths"][sel]))
        done += len(chunk)
        manifest = write_manifest(out, rows, model=model, source=os.path.basename(SHAREGPT_FILE),
                                  vocab_size=len(m.tokenizer), max_len=max_len, pad_id=pad_id, new_tokens=new_tokens,
                                  max_prompt=max_prompt, prompts=len(items), eval_fraction=eval_fraction, sort=sort)
        print(f"part {part}: {done}/{len(items)} prompts, {manifest['splits']['train']['loss_tokens']} answer tokens, "
              f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return manifest


def part_size(path: str) -> int:
    with np.load(path) as f:
        return len(f["lengths"])


def write_manifest(out: str, rows: dict, **meta) -> dict:
    manifest = {"format": FORMAT, "kind": "self-distilled greedy answers", **meta, "splits": {}}
    for split, split_parts in rows.items():
        arrays = [np.concatenate(x) if x else np.zeros((0, meta["max_len"]), np.int32) for x in zip(*split_parts)] \
            if split_parts else [np.zeros((0, meta["max_len"]), np.int32)] * 2 + [np.zeros(0, np.int32)]
        manifest["splits"][split] = write_split(out, split, *arrays, shard_rows=1 << 20)
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def main(argv=None):
    p = Parser(prog="python -m train.distill", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--checkpoint", help="the model's weights where its package is not installed (a GGUF file)")
    p.add_argument("--out", required=True, help="output folder for parts, shards and manifest.json")
    p.add_argument("--prompts", type=int, default=3000,
                   help="ShareGPT first turns to answer (the first this many no longer than --max-prompt)")
    p.add_argument("--new-tokens", type=int, default=160)
    p.add_argument("--max-prompt", type=int, default=192, help="longer prompts are left out")
    p.add_argument("--batch-size", type=int, default=16, help="16 measured fastest per row on 2 cores (32 and 64 slower)")
    p.add_argument("--part-rows", type=int, default=256, help="prompts per resumable part")
    p.add_argument("--eval-fraction", type=float, default=0.02)
    p.add_argument("--sort", choices=("all", "part"), default="all",
                   help="sort every prompt by length (least padding; the first parts are the shortest prompts), "
                        "or each part (each part spans ShareGPT's lengths)")
    args = p.parse_args(argv)
    output_folder(args.out)
    m = distill(args.model, args.out, prompts=args.prompts, new_tokens=args.new_tokens, max_prompt=args.max_prompt,
                batch_size=args.batch_size, part_rows=args.part_rows, eval_fraction=args.eval_fraction,
                sort=args.sort, checkpoint=args.checkpoint)
    print(f"{m['prompts']} prompts answered: train {m['splits']['train']['rows']} rows / "
          f"{m['splits']['train']['loss_tokens']} answer tokens, eval {m['splits']['eval']['rows']} rows -> {args.out}")


if __name__ == "__main__":
    run(main)
