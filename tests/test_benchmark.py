"""`python -m infer.benchmark`: the metric arithmetic by hand, and its refusals (a tiny end-to-end run's files are
checked in test_gpu_suite, whose --tiny pipeline runs it)."""

import pytest

from infer import benchmark


def test_summary_metrics_by_hand():
    runs = [{"tokens": [1, 2, 3, 4, 5], "decode_s": 2.0, "ttft_s": 0.1, "accepted_per_step": [2, 0]},
            {"tokens": [7, 8, 9], "decode_s": 1.0, "ttft_s": 0.3, "accepted_per_step": [1]}]
    ar = [{"tokens": [1, 2, 3, 4, 5], "decode_s": 4.0, "ttft_s": 0.2},
          {"tokens": [7, 8, 0], "decode_s": 2.0, "ttft_s": 0.2}]
    s = benchmark.summarize(runs, ar, depth=3, memory_bytes=150, baseline_memory_bytes=100)
    # 6 tokens after the first in 3 s, against ar's 6 in 6 s
    assert s["tokens_per_s"] == 2.0 and s["speedup"] == 2.0
    assert s["memory_normalized_speedup"] == pytest.approx(2.0 / 1.5)
    assert s["identical"] == 0.5 and s["ttft_s"] == pytest.approx(0.2) and s["new_tokens"] == 8
    # steps accepting 2, 0 and 1 drafts: 3, 1 and 2 tokens each; 2 of 3 reach depth 1, 1 of those 2 depth 2
    assert s["tau"] == 2.0 and s["verify_steps"] == 3
    assert s["acceptance_by_depth"] == pytest.approx([2 / 3, 1 / 2, 0.0])
    sampled = benchmark.summarize(runs, ar, depth=3, memory_bytes=150, baseline_memory_bytes=100, greedy=False)
    assert sampled["identical"] is None and sampled["speedup"] == 2.0
    base = benchmark.summarize(ar, None, depth=0, memory_bytes=100, baseline_memory_bytes=100)
    assert base["speedup"] == 1.0 and base["memory_normalized_speedup"] == 1.0 and "tau" not in base


def test_a_bad_flag_is_one_line_and_exit_code_2():
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "infer.benchmark", "--limit", "0", "--out", "x"], capture_output=True,
                       text=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "python -m infer.benchmark: error: argument --limit: invalid value 0"]
