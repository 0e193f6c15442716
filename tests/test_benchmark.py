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


def test_divergences_are_found_where_outputs_first_part():
    from benchmarks.divergence import divergences, first_difference

    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 7]) == 2  # one stopped where the other went on
    record = {"runs": {"mt-bench": {"ar": [{"id": 81, "tokens": [4, 5, 6]}, {"id": 82, "tokens": [1, 2]}],
                                    "s3d": [{"id": 81, "tokens": [4, 5, 6]}, {"id": 82, "tokens": [1, 9, 9]}]}}}
    assert divergences(record) == [{"dataset": "mt-bench", "method": "s3d", "id": 82, "at": 1, "ar": 2, "other": 9}]


def test_the_divergence_scorer_ranks_greedy_ars_own_tokens_first():
    import numpy as np

    from benchmarks.divergence import scorer
    from s3djax.decode import ARDecoder, Runner
    from tiny import TINY, tiny_model

    m = tiny_model(seed=2)
    prompt = [5, 17, 3, 99, 41]
    tokens = Runner(ARDecoder(TINY, 96, eos_ids=()), m.params).generate(prompt, 12).tokens
    score = scorer(m)  # lengths 5 to 16 fall in one 64-token bucket: the padding must not reach them
    assert [int(np.argmax(score(prompt + tokens[:i]))) for i in range(len(tokens))] == tokens


def test_the_divergence_report_refuses_what_it_cannot_read(tmp_path):
    import json
    import os
    import subprocess
    import sys

    sampled = tmp_path / "results.json"
    sampled.write_text(json.dumps({"settings": {"temperature": 0.7}, "runs": {}}))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for path, message in ((tmp_path / "none.json", "cannot read"), (sampled, "was sampled (temperature 0.7)")):
        r = subprocess.run([sys.executable, "-m", "benchmarks.divergence", str(path)], capture_output=True, text=True,
                           cwd=root, timeout=120)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and message in r.stderr, r.stderr


def test_a_chain_simulated_from_teacher_forced_correctness_steps_as_verification_does():
    import numpy as np

    from benchmarks.research.held_out_acceptance import chain_steps

    # anchor p drafts answer tokens p+1 .. p+4; a step accepts the leading right depths, then its bonus
    # token is the next anchor's last token, so the next step starts k + 1 anchors on
    c = np.array([[1, 1, 0, 1], [0, 0, 0, 0], [0, 0, 0, 0], [0, 1, 1, 1], [1, 1, 1, 1],
                  [1, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], bool)
    assert chain_steps(c, 4, 10) == [2, 0, 4, 4]      # anchors 0, 3, 4, 9
    assert chain_steps(c, 2, 10) == [2, 0, 2, 0, 0, 2]  # anchors 0, 3, 4, 7, 8, 9
    assert chain_steps(c, 1, 10) == [1, 0, 0, 1, 0, 0, 0, 1]  # anchors 0, 2, 3, 4, 6, 7, 8, 9
    assert chain_steps(c, 4, 4) == [2, 0]             # only anchors before the limit start a step


def test_a_sampled_batched_run_on_smollm2(tmp_path):
    # ar decodes each batch of 2 as one; ar-greedy beside it gives what sampling costs; lookup runs prompt by prompt,
    # and lookup-greedy, what sampling costs it, gives greedy ar's tokens.
    import json

    benchmark.main(["--methods", "ar,ar-greedy,lookup,lookup-greedy", "--dataset", "mt-bench", "--limit", "3", "--max-new-tokens",
                    "12", "--max-cache-len", "512", "--batch", "2", "--temperature", "0.7", "--top-p", "0.9",
                    "--seed", "3", "--out", str(tmp_path)])
    record = json.loads((tmp_path / "results.json").read_text())
    summary, runs = record["summary"]["mt-bench"], record["runs"]["mt-bench"]
    assert set(summary) == {"ar", "ar-greedy", "lookup", "lookup-greedy"} and all(s["prompts"] == 3 for s in summary.values())
    assert [r["tokens"] for r in runs["lookup-greedy"]] == [r["tokens"] for r in runs["ar-greedy"]]
    assert summary["lookup"]["identical"] is None and 0.0 <= summary["lookup"]["paused"] <= 1.0
    # the first batch's two ar rows share its decode time equally; the third prompt ran alone
    assert runs["ar"][0]["decode_s"] == runs["ar"][1]["decode_s"] != runs["ar"][2]["decode_s"]
    assert "batches of 2 prompts" in (tmp_path / "results.md").read_text()


def test_a_multi_turn_run_asks_the_second_turn_on_the_first_answers_cache(tmp_path):
    # lookup runs as a variant whose option reaches its build: at max draft 1 no step accepts two drafts.
    import json

    lookup = "lookup@max-draft=1"
    benchmark.main(["--methods", f"ar,{lookup}", "--dataset", "mt-bench-multiturn", "--limit", "2", "--max-new-tokens",
                    "12", "--max-cache-len", "512", "--out", str(tmp_path)])
    record = json.loads((tmp_path / "results.json").read_text())
    summary, runs = record["summary"]["mt-bench-multiturn"], record["runs"]["mt-bench-multiturn"]
    assert summary[lookup]["identical"] == 1.0 and summary["ar"]["prompts"] == 2
    # Both turns' answers are in each run, and lookup's verify steps cover both.
    assert all(len(r["tokens"]) > 12 for r in runs["ar"])
    assert sum(len(r["accepted_per_step"]) + sum(r["accepted_per_step"]) for r in runs[lookup]) == \
        sum(len(r["tokens"]) for r in runs[lookup]) - 2 * 2
    assert max(a for r in runs[lookup] for a in r["accepted_per_step"]) == 1


def test_rounds_pass_over_the_prompts_again(tmp_path):
    import json

    benchmark.main(["--methods", "ar", "--dataset", "mt-bench", "--limit", "1", "--max-new-tokens", "6",
                    "--max-cache-len", "512", "--rounds", "2", "--out", str(tmp_path)])
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]["mt-bench"]["ar"]
    assert [r["id"] for r in runs] == [runs[0]["id"]] * 2 and runs[0]["tokens"] == runs[1]["tokens"]  # greedy
    assert "2 rounds over the prompts" in (tmp_path / "results.md").read_text()


def test_method_variants_expand_every_combination_and_refuse_bad_options():
    from s3djax.errors import UserError
    from s3djax.options import variant, variants

    assert variants("s3d") == ["s3d"]
    assert variants("s3d@gamma=2|4+lookup=0|default") == [
        "s3d@gamma=2+lookup=0", "s3d@gamma=2+lookup=default", "s3d@gamma=4+lookup=0", "s3d@gamma=4+lookup=default"]
    assert variant("s3d@gamma=4+lookup=default+skip=default") == ("s3d", {"gamma": 4, "lookup": None, "skip": ""})
    assert variant("s3d@draft=none+in-verify=on+tree=top2") == ("s3d", {"draft_path": "none", "in_verify": "on",
                                                                        "tree": "top2"})
    for bad, says in (("s3d@gama=2", "unknown option 'gama'"), ("s3d@gamma=two", "gamma takes int values"),
                      ("s3d@in-verify=yes", "in-verify is one of on, off"), ("s3d@gamma", "write FLAG=VALUE")):
        with pytest.raises(UserError, match=says):
            variants(bad)
