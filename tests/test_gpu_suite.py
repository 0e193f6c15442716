"""`python -m benchmarks.gpu_suite`: the whole pipeline on tiny models (--tiny, on this CPU), the rules of
resuming, and its one-line refusals."""

import json
import os
import subprocess
import sys
import tarfile

import pytest

from benchmarks import gpu_suite
from benchmarks.gpu_suite import Piece
from s3djax.errors import UserError
from s3djax.speculative.drafters.s3d import default_gamma

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def suite(*argv):
    return subprocess.run([sys.executable, "-m", "benchmarks.gpu_suite", *argv], capture_output=True, text=True, cwd=ROOT)


def the_record(out):
    (folder,) = [os.path.join(out, d) for d in os.listdir(out) if d.startswith("gpu-suite-")]
    with open(os.path.join(folder, "suite.json")) as f:
        return folder, json.load(f)


def test_tiny_runs_every_piece_and_a_rerun_skips_them(tmp_path):
    out, tar = str(tmp_path / "results"), str(tmp_path / "suite.tar.gz")
    r = suite("--out", out, "--tiny", "--archive", tar)
    assert r.returncode == 0, r.stderr[-3000:]
    folder, record = the_record(out)
    assert os.path.basename(folder).startswith("gpu-suite-tiny-cpu-jax")
    assert list(record["pieces"]) == ["tiny-model", "tiny-data", "compile", "lowering", "kernels", "steps", "tune", "tree-attention", "int8-decode",
                                      "bench-mt-bench-bf16-xla", "projection", "bench-humaneval-int8-pallas", "train-s3d"]
    assert {p["status"] for p in record["pieces"].values()} == {"done"}
    for piece in ("lowering", "kernels"):
        junit = open(os.path.join(folder, piece, "junit.xml")).read()
        assert 'failures="0"' in junit and 'errors="0"' in junit and 'tests="0"' not in junit
    for name, dataset, first in (("bench-mt-bench-bf16-xla", "mt-bench", "81"), ("bench-humaneval-int8-pallas", "humaneval", "HumanEval/0")):
        with open(os.path.join(folder, name, "results.json")) as f:
            bench = json.load(f)
        assert set(bench) >= {"device", "jax", "commit", "date", "summary", "runs", "notes", "settings"}
        methods = bench["summary"][dataset]
        assert set(methods) == {"ar", "s3d"} | ({"hf-ar"} if name.endswith("bf16-xla") else set())
        assert all(m["identical"] == 1.0 and m["prompts"] == 1 for m in methods.values())
        assert bench["device"].startswith("CPU") and methods["ar"]["speedup"] == 1.0
        s3d = methods["s3d"]
        # The gamma it ran with is recorded (the projection reads it): unset, the data file's (the suite fixes defaults).
        assert bench["settings"]["gamma"] == default_gamma("chain") == len(s3d["acceptance_by_depth"])
        assert s3d["verify_steps"] >= 1
        assert s3d["speedup"] == pytest.approx(s3d["tokens_per_s"] / methods["ar"]["tokens_per_s"])
        assert [r["id"] for r in bench["runs"][dataset]["s3d"]] == [first]
        table = open(os.path.join(folder, name, "results.md")).read()
        assert f"| {dataset} | ar | 1 |" in table and f"| {dataset} | s3d | 1 |" in table and bench["device"] in table
        assert all(os.path.getsize(os.path.join(folder, name, png)) > 1000 for png in ("acceptance.png", "speed.png"))
    assert bench["quant"] == "int8" and bench["settings"]["attention"] == bench["settings"]["matmul"] == "pallas"
    assert os.path.exists(os.path.join(folder, "train-s3d", "draft.npz"))
    with open(os.path.join(folder, "steps", "gpu_steps.jsonl")) as f:  # issue 70's settings, each timed
        steps = [json.loads(line) for line in f]
    assert [r["setting"] for r in steps if "setting" in r] == ["smollm2/new"]  # the GPU defaults, S3D's steps too
    assert all(r["ar_ms"] > 0 and len(r["tokens"]) == 8 and r["s3d"]["verify_tree64_ms"] > 0 for r in steps if "setting" in r)
    assert any(f.startswith("projection") for f in os.listdir(os.path.join(folder, "projection")))
    with tarfile.open(tar) as t:
        names = t.getnames()
    assert os.path.basename(folder) + "/summary.md" in names and not any("/checkpoints" in n for n in names)

    again = suite("--out", out, "--tiny")
    assert again.returncode == 0 and "0 of 13 pieces to run" in again.stderr


def test_what_is_missing_is_one_line_before_anything_runs(tmp_path):
    r = suite("--out", str(tmp_path), "--only", "train-s3d", "--train-data", str(tmp_path / "none"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith("error: missing: a CUDA GPU") and f"training shards in {tmp_path / 'none'}" in r.stderr
    assert not any(d.startswith("gpu-suite-") for d in os.listdir(tmp_path))  # failed before making its folder
    bad = suite("--out", str(tmp_path), "--only", "benchmark")
    assert bad.returncode == 2 and bad.stderr.startswith("error: unknown piece 'benchmark'; the pieces: compile, lowering, kernels")


def test_lower_only_is_the_lowering_tests_alone(tmp_path):
    args = gpu_suite.parse_args(["--out", str(tmp_path), "--lower-only"])
    (piece,) = gpu_suite.pieces(args, str(tmp_path))
    assert piece.name == "lowering" and "tests/test_gpu_lowering.py" in piece.argv and "-k" not in piece.argv


def test_compile_only_is_the_compile_piece_alone_and_it_comes_first(tmp_path):
    (piece,) = gpu_suite.pieces(gpu_suite.parse_args(["--out", str(tmp_path), "--compile-only"]), str(tmp_path))
    assert piece.name == "compile" and piece.argv[:2] == ("-m", "benchmarks.h100_compile") and "--only" not in piece.argv
    everything = gpu_suite.pieces(gpu_suite.parse_args(["--out", str(tmp_path)]), str(tmp_path))
    assert everything[0] == piece  # compiled before anything is measured


def test_the_batches_run_right_after_the_headline_benchmark_each_drafting_in_four_full_batches(tmp_path):
    names = {q.name: q for q in gpu_suite.pieces(gpu_suite.parse_args(["--out", str(tmp_path)]), str(tmp_path))}
    order = list(names)
    assert order.index("bench-mt-bench-bf16-xla-batch-4") == order.index("bench-humaneval-bf16-xla") + 1
    for b in gpu_suite.BATCHES:
        argv = names[f"bench-mt-bench-bf16-xla-batch-{b}"].argv
        assert argv[argv.index("--batch") + 1] == str(b) and argv[argv.index("--limit") + 1] == str(4 * b)
        assert argv[argv.index("--methods") + 1] == gpu_suite.BATCH_METHODS


FAKE = [Piece("ok", ("-c", "print('fine')")), Piece("bad", ("-c", "import sys; sys.exit(3)")),
        Piece("slow", ("-c", "import time; time.sleep(60)")), Piece("reader", ("-c", "print('read')"), after="bad")]


def test_finished_pieces_are_skipped_failed_ones_kept_and_cut_ones_rerun(tmp_path, monkeypatch):
    fake = list(FAKE)
    monkeypatch.setattr(gpu_suite, "pieces", lambda args, run_dir: fake)
    argv = ["--out", str(tmp_path), "--piece-timeout-s", "3"]
    with pytest.raises(UserError, match="some pieces did not finish"):
        gpu_suite.main(argv)
    folder, record = the_record(str(tmp_path))
    assert {k: p["status"] for k, p in record["pieces"].items()} == {
        "ok": "done", "bad": "failed (exit 3)", "slow": "timed out at 3 s"}  # reader waits for bad
    assert open(os.path.join(folder, "ok", "log.txt")).read().endswith("fine\n")

    with pytest.raises(UserError):
        gpu_suite.main(argv)
    attempts = {k: p["attempts"] for k, p in the_record(str(tmp_path))[1]["pieces"].items()}
    assert attempts == {"ok": 1, "bad": 1, "slow": 2}

    fake[1:3] = Piece("bad", ("-c", "print('fixed')")), Piece("slow", ("-c", "print('quick now')"))
    gpu_suite.main(argv + ["--retry-failed"])
    _, record = the_record(str(tmp_path))
    assert {p["status"] for p in record["pieces"].values()} == {"done"} and set(record["pieces"]) == {"ok", "bad", "slow", "reader"}
    assert "| reader | done |" in open(os.path.join(folder, "summary.md")).read()


def test_a_deadline_starts_nothing_it_cannot_finish(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_suite, "pieces", lambda args, run_dir: FAKE[:1])
    gpu_suite.main(["--out", str(tmp_path), "--deadline-s", "1", "--piece-timeout-s", "120"])
    assert the_record(str(tmp_path))[1]["pieces"] == {}
