"""ShareGPT -> token shards: record recovery, turn cleaning, chat-template rendering, loss mask, split."""

import collections
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from s3djax import sharegpt
from train import prepare_data as pd
from train.shards import Shards


@pytest.fixture(scope="module")
def tokenizer():
    from s3djax.loading import load_tokenizer

    return load_tokenizer("smollm2-135m")


def test_complete_records_are_recovered_from_a_truncated_array(tmp_path):
    records = [{"id": f"c{i}", "conversations": [{"from": "human", "value": "x" * i}]} for i in range(5)]
    text = json.dumps(records, indent=2)
    cut = tmp_path / "cut.json"
    cut.write_text(text[: text.index('"c4"') + 10])  # mid-way through the last record
    got, truncated = sharegpt.read_records(str(cut))
    assert truncated and got == records[:4]
    whole = tmp_path / "whole.json"
    whole.write_text(text)
    assert sharegpt.read_records(str(whole)) == (records, False)


def test_the_shipped_sharegpt_file_is_truncated_but_its_first_records_decode():
    got, truncated = sharegpt.read_records(sharegpt.sharegpt_path(), limit=30)
    assert len(got) == 30 and not truncated and all("conversations" in r for r in got)


def test_turn_cleaning_maps_roles_and_counts_what_it_drops():
    dropped = collections.Counter()
    turns = [{"from": "gpt", "value": "orphan answer"}, {"from": "human", "value": "hi"},
             {"from": "gpt", "value": "  "}, {"from": "gpt"}, "junk", {"from": "alien", "value": "?"},
             {"from": "chatgpt", "value": "hello"}, {"from": "system", "value": "late system"}]
    assert sharegpt.clean_turns(turns, dropped) == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert dropped == {"leading assistant turn": 1, "empty turn": 1, "malformed turn": 2, "unknown role 'alien'": 1,
                       "system turn after the start": 1}


def test_rendering_is_the_whole_template_and_masks_exactly_the_answers(tokenizer):
    messages = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is 4."},
                {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "Six, of course."}]
    tokens, mask = pd.render(tokenizer, messages, "assistant")
    whole = tokenizer.apply_chat_template(messages, tokenize=False)
    assert tokens == tokenizer(whole, add_special_tokens=False)["input_ids"]
    spans, current = [], []
    for t, m in zip(tokens, mask):
        if m:
            current.append(t)
        elif current:
            spans.append(tokenizer.decode(current))
            current = []
    spans += [tokenizer.decode(current)] if current else []
    assert spans == ["It is 4.<|im_end|>\n", "Six, of course.<|im_end|>\n"]
    assert all(pd.render(tokenizer, messages, "all")[1])


def test_held_out_choice_depends_only_on_the_conversation_id():
    ids = [f"conv{i}" for i in range(2000)]
    chosen = [i for i in ids if sharegpt.is_held_out(i, 0.1)]
    assert chosen == [i for i in ids if sharegpt.is_held_out(i, 0.1)]
    assert 120 < len(chosen) < 280
    assert not any(sharegpt.is_held_out(i, 0.0) for i in ids)


@pytest.mark.parametrize("pack", [False, True], ids=["truncate", "pack"])
def test_a_small_slice_becomes_numpy_shards_with_a_manifest(tmp_path, pack):
    m = pd.prepare("smollm2-135m", str(tmp_path), max_len=128, pack=pack, eval_fraction=0.2, limit=60,
                   shard_rows=16, progress=False)
    assert m["records"] == 60 and m["conversations"]["eval"] > 0
    assert sum(m["conversations"].values()) + sum(m["skipped_conversations"].values()) == 60
    train, held_out = Shards(str(tmp_path), "train"), Shards(str(tmp_path), "eval")
    assert train.tokens.shape[1] == 128 and len(m["splits"]["train"]["shards"]) == -(-len(train) // 16)
    assert int(train.loss_mask.sum()) == m["splits"]["train"]["loss_tokens"] > 0
    beyond = np.arange(128)[None] >= train.lengths[:, None]
    assert not train.loss_mask[beyond].any() and (train.tokens[beyond] == m["pad_id"]).all()
    if pack:
        assert (train.lengths == 128).all()
    else:  # each row starts a conversation with the template's system prompt
        assert (train.tokens[:, 0] == 1).all() and len(train) == m["conversations"]["train"]
    # The same rows of the same conversations come out on a second run.
    again = pd.prepare("smollm2-135m", str(tmp_path / "again"), max_len=128, pack=pack, eval_fraction=0.2, limit=60,
                       progress=False)
    assert (Shards(str(tmp_path / "again"), "eval").tokens == held_out.tokens).all() and again["conversations"] == m["conversations"]


def test_batches_are_a_pure_function_of_the_micro_step(tmp_path):
    pd.prepare("smollm2-135m", str(tmp_path), max_len=64, eval_fraction=0.0, limit=20, progress=False)
    s = Shards(str(tmp_path), "train")
    seen = np.concatenate([s.batch(3, k, 4)["tokens"] for k in range(len(s) // 4)])
    assert len(set(map(bytes, seen))) == len(seen) > 8  # an epoch visits each row once
    assert (s.batch(3, 2, 4)["tokens"] == Shards(str(tmp_path), "train").batch(3, 2, 4)["tokens"]).all()
    assert not (s.batch(3, 0, 4)["tokens"] == s.batch(4, 0, 4)["tokens"]).all()


@pytest.mark.parametrize("args, message", [
    (["--source", "/no/such.json"], "no such file: /no/such.json"),
    (["--max-len", "2"], "--max-len must be at least 8"),
    (["--model", "gpt-17"], "unknown model 'gpt-17'"),
    (["--eval-fraction", "1.5"], "--eval-fraction must be in [0, 1)"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    r = subprocess.run([sys.executable, "-m", "train.prepare_data", "--out", str(tmp_path / "o"), *args],
                       capture_output=True, text=True)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_missing_shards_say_how_to_make_them(tmp_path):
    from s3djax.errors import UserError

    with pytest.raises(UserError, match="run `python -m train.prepare_data"):
        Shards(str(tmp_path), "train")
    # A clone has the committed distilled answers' manifest and parts, not the shards git ignores.
    manifest = os.path.join(os.path.dirname(os.path.dirname(__file__)), "train/distilled/smollm2-sharegpt-10k/manifest.json")
    shutil.copy(manifest, tmp_path)
    answered = sum(split["rows"] for split in json.load(open(manifest))["splits"].values())  # 14,080
    with pytest.raises(UserError, match=r"lacks its shard train-00000.npz: rerun the `python -m train.distill "
                                        rf"--out {tmp_path}` that made it with --prompts {answered},"):
        Shards(str(tmp_path), "train")
