"""`python -m infer.generate` as a user runs it: JSON output, streaming, and one-line errors (exit 2)."""

import json
import os
import subprocess
import sys

import pytest

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
    stats = [line for line in r.stderr.splitlines() if line.startswith("[ar]")]
    assert stats and "tokens/s decode" in stats[0] and "time to first token" in stats[0] and "compile" in stats[0]


def test_streams_text_from_stdin_prompt():
    r = generate("--prompt-file", "/dev/stdin", "--max-new-tokens", "12", "--max-cache-len", "128",
                 "--no-chat-template", stdin="The capital of France is")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


@pytest.mark.parametrize("args, message", [
    (["--model", "gpt-9"], "unknown model 'gpt-9'"),
    (["--model", "/no/such/model.gguf"], "no such file or folder"),
    (["--model", "llama-2-7b"], "pass --checkpoint DIR"),
    (["--method", "beam"], "invalid choice: 'beam'"),
    (["--max-new-tokens", "0"], "--max-new-tokens: invalid value 0"),
    (["--dtype", "float8"], "invalid choice: 'float8'"),
    (["--quant", "int4"], "invalid choice: 'int4'"),
    (["--prompt-file", "/no/such/prompt.txt"], "cannot read --prompt-file"),
    (["--bogus-flag"], "unrecognized arguments"),
    (["--prompt-file", "/etc/hostname", "--prompt", "x"], "not allowed with argument"),
    (["--skip", "0-29"], "nothing is left to run"),
    (["--skip", "28-31"], "outside 0-29"),
    (["--max-cache-len", "8"], "raise --max-cache-len"),
])
def test_bad_input_is_one_line_and_exit_code_2(args, message):
    prompt = [] if "--prompt-file" in args else ["--prompt", "hello there, how are you today?"]
    r = generate(*prompt, *args)
    assert r.returncode == 2
    progress = ("loading ", "loaded ")
    lines = [line for line in r.stderr.splitlines() if line.strip() and not line.startswith(progress)]
    assert len(lines) == 1 and message in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_s3d_prints_the_same_text_as_ar_and_reports_acceptance():
    common = ["--prompt", "Name three primary colors.", "--max-new-tokens", "24", "--max-cache-len", "128", "--json"]
    ar, s3d = generate("--method", "ar", *common), generate("--method", "s3d", "--tree", "tree-8", "--draft", "none", *common)
    assert ar.returncode == 0 and s3d.returncode == 0, s3d.stderr
    ar_out, s3d_out = (json.loads(r.stdout.strip().splitlines()[-1]) for r in (ar, s3d))
    assert s3d_out["text"] == ar_out["text"] and s3d_out["method"] == "s3d"
    assert s3d_out["verify_steps"] >= 1 and len(s3d_out["acceptance_by_depth"]) == 4
    assert 1.0 <= s3d_out["mean_accepted_tokens"] <= 5.0
    assert "warning: no trained draft" in s3d.stderr


@pytest.mark.parametrize("args, message", [
    (["--method", "s3d", "--tree", "bush"], "unknown tree 'bush'"),
    (["--method", "s3d", "--tree", "tree-16", "--gamma", "2"], "raise --gamma to 4"),
    (["--method", "s3d", "--gamma", "0"], "argument --gamma: invalid value 0"),
    (["--method", "s3d", "--draft", "/no/such/draft.npz"], "no such draft file"),
])
def test_s3d_bad_input_is_one_line_and_exit_code_2(args, message):
    r = generate("--prompt", "hello", *args)
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip() and not line.startswith(("loading ", "warning:"))]
    assert len(lines) == 1 and message in lines[0], r.stderr
