"""An 8,000-token prompt (SmolLM2's context is 8,192) through `python -m benchmarks.prefill`, as a user runs it: it
prefills and decodes within the CI's memory, and the long-prompt benchmark writes its tables."""

import glob
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The process's peak resident set may not pass this. SmolLM2-135M's fp32 weights with their packed copies, an
# 8,192-slot fp32 cache (360 MiB), the held-out ShareGPT text and jax came to 2,834 MB on an Intel Xeon at 7,999 tokens
# (2026-12-01); one layer's dense 8k x 8k scores over its 9 heads alone would add 2.4 GB.
PEAK_MB = 4000


def table_row(text: str, heading: str) -> list[str]:
    """The one data row of the markdown table under `heading`."""
    after = text.split(heading, 1)[1]
    table = after[after.index("\n|") + 1:].split("\n\n", 1)[0].splitlines()
    rows = [line.strip("| ").split(" | ") for line in table[2:]]
    assert len(rows) == 1, rows
    return rows[0]


def test_an_8k_prompt_runs_within_memory_and_is_reported(tmp_path):
    env = dict(os.environ, JAX_DISABLE_MOST_OPTIMIZATIONS="0")  # the compile a user's run gets (conftest sets 1)
    r = subprocess.run([sys.executable, "-m", "benchmarks.prefill", "--tokens", "8000", "--methods", "ar", "--quant",
                        "none", "--kv-dtype", "none", "--peers", "none", "--new-tokens", "4", "--repeats", "1",
                        "--out", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=1200, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    (path,) = glob.glob(str(tmp_path / "prefill-*.md"))
    text = open(path).read()
    assert "--max-cache-len 8192" in text and "KV cache 360 MB fp32" in text
    tokens, ttft, peak = table_row(text, "## Time to first token")
    assert 7992 < int(tokens) <= 8000 and float(ttft) > 0
    assert float(peak) < PEAK_MB, f"peak resident set {peak} MB at {tokens} tokens"
    decode_tokens, rate = table_row(text, "## Decode after the prompt")
    assert decode_tokens == tokens and float(rate) > 0
