"""`python -m infer.benchmark`: the metric arithmetic by hand, and a tiny end-to-end run's files."""

import json

import pytest

from infer import benchmark
from tests.tiny import TINY, random_params


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


@pytest.fixture(scope="module")
def tiny_folder(smollm2, tmp_path_factory):
    """A tiny random Llama over SmolLM2's vocabulary, as a checkpoint folder with SmolLM2's tokenizer."""
    from s3djax import weights

    folder = str(tmp_path_factory.mktemp("tiny-model"))
    weights.save_hf_folder(folder, TINY, random_params(TINY, 0), smollm2.tokenizer)
    return folder


def test_a_tiny_run_writes_results_and_plots(tiny_folder, tmp_path):
    out = tmp_path / "run"
    benchmark.main(["--model", tiny_folder, "--methods", "ar,s3d", "--dataset", "mt-bench", "--limit", "2",
                    "--max-new-tokens", "12", "--max-cache-len", "256", "--draft", "none", "--skip", "1-2",
                    "--out", str(out)])
    record = json.loads((out / "results.json").read_text())
    assert set(record) >= {"device", "jax", "commit", "date", "summary", "runs", "notes", "settings"}
    assert record["device"].startswith("CPU") and set(record["summary"]) == {"mt-bench"}
    ar, s3d = record["summary"]["mt-bench"]["ar"], record["summary"]["mt-bench"]["s3d"]
    assert ar["prompts"] == s3d["prompts"] == 2 and ar["speedup"] == 1.0
    assert s3d["identical"] == 1.0 and s3d["verify_steps"] >= 1 and len(s3d["acceptance_by_depth"]) == 4
    assert s3d["speedup"] == pytest.approx(s3d["tokens_per_s"] / ar["tokens_per_s"])
    assert [r["id"] for r in record["runs"]["mt-bench"]["s3d"]] == ["81", "82"]
    table = (out / "results.md").read_text()
    assert "| mt-bench | ar | 2 |" in table and "| mt-bench | s3d | 2 |" in table and record["device"] in table
    assert (out / "acceptance.png").stat().st_size > 1000 and (out / "speed.png").stat().st_size > 1000


def test_a_bad_flag_is_one_line_and_exit_code_2():
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "infer.benchmark", "--limit", "0", "--out", "x"], capture_output=True,
                       text=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "python -m infer.benchmark: error: argument --limit: invalid value 0"]
