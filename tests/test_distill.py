import json
import os

import numpy as np
import pytest

from s3djax.errors import UserError
from train.distill import parts, saved_prompts


def test_parts_sort_all_prompts_or_only_within_each_part():
    lengths = [5, 1, 9, 3, 7, 2, 8]
    items = [(f"c{i}", [0] * n) for i, n in enumerate(lengths)]
    size = lambda part: [len(ids) for _, ids in part]  # noqa: E731

    assert [size(p) for p in parts(items, 3, "all")] == [[1, 2, 3], [5, 7, 8], [9]]
    # Each part holds the same prompts as that slice of the source order: later parts keep long and short ones.
    assert [size(p) for p in parts(items, 3, "part")] == [[1, 5, 9], [2, 3, 7], [8]]
    assert [cid for p in parts(items, 3, "part") for cid, _ in p] == ["c1", "c0", "c2", "c5", "c3", "c4", "c6"]


def _records(texts):
    return [{"id": f"r{i}", "conversations": [{"from": "human", "value": t}, {"from": "gpt", "value": "ok"}]}
            for i, t in enumerate(texts)]


def test_chosen_prompts_are_saved_and_reused_without_sharegpt(tmp_path, monkeypatch):
    from s3djax.loading import load_tokenizer
    from train import distill

    tokenizer = load_tokenizer("smollm2-135m")
    texts = ["Hi there", "word " * 400, "What is 2 + 2?", "Name a colour", "Tell me a joke"]
    monkeypatch.setattr(distill, "sharegpt_path", lambda: "ShareGPT.json")
    monkeypatch.setattr(distill, "read_records", lambda path: (_records(texts), False))
    path = str(tmp_path / "prompts.npz")
    chosen = distill.chosen_prompts(tokenizer, path, model="smollm2-135m", count=3, max_prompt=64)
    assert [cid for cid, _ in chosen] == ["r0", "r2", "r3"]  # the 400-word prompt is over the limit

    # A GPU machine has no ShareGPT: the saved choice serves any count up to its own.
    monkeypatch.setattr(distill, "read_records", lambda path: pytest.fail("ShareGPT was read again"))
    assert distill.chosen_prompts(tokenizer, path, model="smollm2-135m", count=3, max_prompt=64) == chosen
    assert distill.chosen_prompts(tokenizer, path, model="smollm2-135m", count=2, max_prompt=64) == chosen[:2]
    for other in ({"count": 4, "max_prompt": 64}, {"count": 3, "max_prompt": 32}):  # a choice it does not hold
        with pytest.raises(pytest.fail.Exception):
            distill.chosen_prompts(tokenizer, path, model="smollm2-135m", **other)

    # A damaged choice is one line of error, not numpy's traceback.
    with open(path, "r+b") as f:
        f.truncate(100)
    with pytest.raises(UserError, match="is not a saved prompt choice .*; delete it to choose again"):
        distill.chosen_prompts(tokenizer, path, model="smollm2-135m", count=3, max_prompt=64)


def test_committed_prompts_are_the_prompts_of_the_committed_parts():
    from s3djax.sharegpt import is_held_out

    folder = os.path.join(os.path.dirname(os.path.dirname(__file__)), "train/distilled/smollm2-sharegpt-10k")
    with open(os.path.join(folder, "manifest.json")) as f:
        manifest = json.load(f)
    with np.load(os.path.join(folder, "prompts.npz")) as f:
        items = saved_prompts(f)
    assert len(items) == manifest["prompts"]
    for k, part in enumerate(parts(items, 256, manifest["sort"])):
        with np.load(os.path.join(folder, f"part-{k:05d}.npz")) as f:
            tokens, held_out = f["tokens"], f["held_out"]
        assert len(tokens) == len(part)
        for row, (_, ids) in zip(tokens, part):
            assert row[:len(ids)].tolist() == ids
        assert held_out.tolist() == [is_held_out(c, manifest["eval_fraction"]) for c, _ in part]


def test_a_larger_prompt_count_refills_the_short_last_part(tmp_path, monkeypatch):
    from train import distill

    texts = ["Hi there", "What is 2 + 2?", "Name a colour", "Tell me a joke"]
    monkeypatch.setattr(distill, "sharegpt_path", lambda: "ShareGPT.json")
    monkeypatch.setattr(distill, "read_records", lambda path: (_records(texts), False))
    run = lambda n: distill.distill("smollm2-135m", str(tmp_path), prompts=n, new_tokens=2, max_prompt=64,  # noqa: E731
                                    batch_size=2, part_rows=2, eval_fraction=0.0, sort="part")
    assert run(3)["prompts"] == 3 and distill.part_size(str(tmp_path / "part-00001.npz")) == 1
    first = os.path.getmtime(tmp_path / "part-00000.npz")
    manifest = run(4)
    assert distill.part_size(str(tmp_path / "part-00001.npz")) == 2  # answered again, whole
    assert os.path.getmtime(tmp_path / "part-00000.npz") == first    # a whole part is kept
    assert manifest["splits"]["train"]["rows"] == 4
