"""A chat that keeps its cache (`Generator.chat`, `python -m infer.chat`) on the real SmolLM2: every method's turns
equal the whole conversation decoded from scratch, a turn prefills only what its cache lacks, and a conversation that
outgrows the cache stops with one line or slides."""

import subprocess
import sys

import pytest

import s3djax
from s3djax.errors import UserError
from s3djax.tokenizer import encode_chat

TURNS = ("Name a primary color.", "Now write a haiku about the sea.", "What is 12 times 7?")
NEW = 16


@pytest.fixture(scope="module")
def gen(smollm2):
    return s3djax.Generator.from_model(smollm2, max_cache_len=512)


@pytest.mark.parametrize("method, options", [("ar", {}), ("s3d", {}), ("s3d", {"in_verify": "on"}), ("self-spec", {}),
                                             ("kangaroo", {}), ("s2d", {}), ("lookup", {})],
                         ids=["ar", "s3d", "s3d-in-verify", "self-spec", "kangaroo", "s2d", "lookup"])
def test_each_turn_equals_the_conversation_from_scratch(gen, method, options):
    chat = gen.chat(method, **options)
    answers = []
    for i, text in enumerate(TURNS):
        out = chat.send(text, NEW)
        ids = encode_chat(gen.tokenizer, chat.messages[:-1])  # this turn's prompt: every message before its answer
        scratch = chat.session.runner.generate(ids, NEW)
        assert out.token_ids == scratch.tokens, f"turn {i + 1}"
        assert out.prompt_tokens == len(ids)
        # Later turns prefill only what the cache lacks: the new message, and at most the last answer's closing.
        assert (out.stats["reused_tokens"] == 0) if i == 0 else (out.stats["reused_tokens"] >= len(ids) - 40)
        answers.append(out.token_ids)
    assert len({tuple(a) for a in answers}) == 3  # three different answers: the comparison is not between constants


def test_a_conversation_too_long_for_the_cache_stops_or_slides(smollm2):
    gen = s3djax.Generator.from_model(smollm2, max_cache_len=160)
    chat = gen.chat()
    chat.send(TURNS[0], NEW)
    with pytest.raises(UserError, match="the cache holds 160: /reset, raise --max-cache-len, or --overflow slide"):
        chat.send(TURNS[1], 150)  # the prompt and an answer of 150 cannot both fit
    chat.reset()
    assert chat.messages == [] and chat.cached_tokens == 0
    sliding = gen.chat(overflow="slide")
    for text in TURNS:
        out = sliding.send(text, 60)
    # The oldest exchanges went; what is left decodes as it would from scratch.
    kept = [m["content"] for m in sliding.messages if m["role"] == "user"]
    assert len(kept) < len(TURNS) and kept == list(TURNS[len(TURNS) - len(kept):])
    ids = encode_chat(gen.tokenizer, sliding.messages[:-1])
    assert len(ids) + 60 <= 160 and out.token_ids == sliding.session.runner.generate(ids, 60).tokens


def run_chat(stdin: str, *args):
    return subprocess.run([sys.executable, "-m", "infer.chat", "--max-new-tokens", "8", "--max-cache-len", "256", *args],
                          input=stdin, capture_output=True, text=True, timeout=600)


def test_the_command_line_takes_turns_and_commands_from_stdin():
    done = run_chat(f"{TURNS[0]}\n/stats\n/reset\n{TURNS[1]}\n/stats\n/nonsense\n{TURNS[2]}\n")
    answers = [line for line in done.stdout.splitlines() if line.strip()]
    assert len(answers) == 2  # a script's bad line ends the run before the third turn
    stats = [line for line in done.stderr.splitlines() if line.startswith("[ar] prompt")]
    # After /reset the second turn starts from an empty cache: nothing reused.
    assert len(stats) == 2 and all("(0 from the cache)" in line for line in stats)
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].startswith("error: unknown command /nonsense")
    assert "Traceback" not in done.stderr
