"""`python -m infer.generate` as a user runs it: JSON output, streaming, and one-line errors (exit 2)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def generate(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "infer.generate", *args], cwd=ROOT, input=stdin,
                          capture_output=True, text=True, timeout=600)


def test_json_output_on_the_real_model():
    r = generate("--model", "smollm2-135m", "--method", "ar", "--prompt", "What is the capital of France?",
                 "--max-new-tokens", "32", "--max-cache-len", "256", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(out) >= {"text", "prompt_tokens", "new_tokens", "tokens_per_s", "compile_s", "device", "method"}
    assert "Paris" in out["text"] and out["method"] == "ar" and 1 <= out["new_tokens"] <= 32
    assert out["tokens_per_s"] > 0 and out["compile_s"] > 0 and out["device"].startswith("CPU")
    assert out["quant"] == "none" and 500 * 2**20 < out["param_bytes"] < 560 * 2**20  # 135M fp32
    assert out["peak_device_bytes"] is None  # the CPU backend keeps no memory statistics
    # stderr is not a terminal here, so it holds the summary lines alone: no progress bar frames.
    lines = r.stderr.splitlines()
    assert "\r" not in r.stderr and len(lines) == 2 and lines[0].startswith("loaded smollm2-135m in "), r.stderr
    assert lines[1].startswith("[ar]") and all(s in lines[1] for s in ("tokens/s decode", "time to first token", "compile"))


def test_streams_text_from_stdin_prompt():
    r = generate("--prompt-file", "/dev/stdin", "--max-new-tokens", "12", "--max-cache-len", "128",
                 "--no-chat-template", stdin="The capital of France is")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_bad_input_in_a_real_process_is_exactly_one_line_and_exit_code_2():
    # tests/test_bad_input.py runs every bad input in-process, with the loader forbidden; this is the
    # whole process, stderr captured as a log would: no bar frame, no warning, no traceback.
    r = generate("--prompt", "hello", "--method", "s3d", "--tree", "no-such-tree")
    assert r.returncode == 2 and r.stderr.splitlines() == [
        "error: unknown tree 'no-such-tree'; known trees: chain, topK (top2, top3, ...), dynamic-N (dynamic-16, ...), "
        "tree-16, tree-32, tree-64, tree-8"], r.stderr
