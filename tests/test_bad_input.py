"""Bad input to every command line is refused before any weight is read: exactly one stderr line,
exit code 2, no traceback. The loader is replaced by one that fails the test, so a check that only
happens after loading shows up as that failure, not as a slow pass."""

import pytest

from infer import benchmark, generate, quantize
from s3djax import cli, weights
from train import distill, s3d, search_skip


@pytest.fixture(autouse=True)
def weights_must_not_be_read(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the weights were read before the bad input was refused")

    monkeypatch.setattr(weights, "from_hf_tensors", refuse)


def refused(main, argv, capsys) -> str:
    """Run a command line's main in this process; its one stderr line."""
    with pytest.raises(SystemExit) as exit_:
        cli.run(lambda: main(argv))
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    assert "Traceback" not in err and "\r" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].strip(), err
    return lines[0]


PROMPT = ["--prompt", "hello there, how are you today?"]


@pytest.mark.parametrize("args, message", [
    (["--model", "gpt-9"], "unknown model 'gpt-9'"),
    (["--model", "/no/such/model.gguf"], "no such file or folder"),
    (["--model", "llama-2-7b"], "pass --checkpoint DIR"),
    (["--method", "beam"], "invalid choice: 'beam'"),
    (["--max-new-tokens", "0"], "--max-new-tokens: invalid value 0"),
    (["--dtype", "float8"], "invalid choice: 'float8'"),
    (["--quant", "int4"], "invalid choice: 'int4'"),
    (["--bogus-flag"], "unrecognized arguments"),
    (["--prompt-file", "/etc/hostname"], "not allowed with argument"),
    (["--skip", "0-29"], "nothing is left to run"),
    (["--skip", "28-31"], "outside 0-29"),
    (["--max-cache-len", "8"], "raise --max-cache-len"),
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--method", "s3d", "--tree", "no-such-tree"], "unknown tree 'no-such-tree'"),
    (["--method", "s3d", "--tree", "tree-16", "--gamma", "2"], "raise --gamma to 4"),
    (["--method", "s3d", "--gamma", "0"], "--gamma must be at least 1"),
    (["--method", "s3d", "--skip", "garbage"], "invalid skip plan 'garbage'"),
    (["--method", "s3d", "--draft", "/no/such/draft.npz"], "no such draft file"),
    (["--method", "s3d", "--draft", "configs/drafts/smollm2-135m-kangaroo.npz"], "unsupported mask token kind"),
    (["--method", "self-spec", "--draft", "/no/such/plan.yaml"], "no such skip plan file"),
    (["--method", "self-spec", "--max-draft", "0"], "--max-draft must be at least 1"),
    (["--method", "lookup", "--ngram", "0"], "--ngram must be at least 1"),
    (["--method", "lookup", "--tree", "top2"], "its tree is the chain, not top2"),
    (["--method", "lookup", "--draft", "configs/drafts/smollm2-135m-s3d.npz"], "with no draft file"),
    (["--method", "lookup", "--max-draft", "0"], "--max-draft must be at least 1"),
    (["--method", "s3d", "--lookup", "-1"], "--lookup must be 0 (never) or more"),
    (["--method", "s3d", "--draft-weights", "int4"], "unknown draft weights 'int4'"),
    (["--method", "s3d", "--lookup", "2", "--tree", "top2"], "s3d's tree must be the chain, not top2"),
    (["--method", "s3d", "--in-verify", "on", "--tree", "tree-8"], "--in-verify drafts a chain, so s3d's tree"),
    (["--method", "s3d", "--in-verify", "yes"], "argument --in-verify: invalid choice"),
    (["--quant", "w8a8", "--matmul", "pallas"], "--quant w8a8 multiplies in integers"),
    (["--method", "kangaroo", "--lookup", "1", "--tree", "top2"], "kangaroo's tree must be the chain, not top2"),
    (["--method", "s2d", "--lookup", "1", "--tree", "top2"], "s2d's tree must be the chain, not top2"),
    (["--method", "kangaroo", "--eta", "3"], "--eta must be in [0, 1]"),
    (["--method", "kangaroo", "--exit-layer", "5"], "not --exit-layer 5"),
    (["--method", "kangaroo", "--draft", "configs/drafts/smollm2-135m-s3d.npz"], "is not a Kangaroo adapter"),
    (["--method", "s2d", "--thresholds", "x"], "invalid --thresholds 'x'"),
    (["--method", "s2d", "--target-from", "/no/such/draft.npz"], "no such draft file"),
])
def test_generate_refuses_bad_input_before_loading(args, message, capsys):
    line = refused(generate.main, (PROMPT if "--prompt-file" not in args else ["--prompt", "x"]) + args, capsys)
    assert message in line


def test_an_unreadable_prompt_file_is_refused(capsys):
    assert "cannot read --prompt-file" in refused(generate.main, ["--prompt-file", "/no/such/prompt.txt"], capsys)


@pytest.mark.parametrize("args, message", [
    (["--methods", "ar,beam"], "unknown method 'beam'"),
    (["--dataset", "gsm8k"], "unknown prompt set 'gsm8k'"),
    (["--max-cache-len", "64"], "no mt-bench prompt fits"),
    (["--methods", "ar,s3d", "--tree", "bush"], "unknown tree 'bush'"),
    (["--methods", "ar,s3d", "--draft", "s4d=x.npz"], "--draft names unknown methods ['s4d']"),
    (["--methods", "ar,kangaroo", "--draft", "kangaroo=/no/such/adapter.npz"], "no such Kangaroo adapter file"),
])
def test_benchmark_refuses_bad_input_before_loading(args, message, tmp_path, capsys):
    assert message in refused(benchmark.main, ["--limit", "1", "--out", str(tmp_path), *args], capsys)


@pytest.mark.parametrize("settings, message", [
    ({"gamma": None, "tree": "chain"}, "does not record the gamma it ran with"),
    ({"gamma": 4, "tree": "tree-16"}, "times a chain verify step"),
])
def test_projection_refuses_a_results_file_it_cannot_use(settings, message, tmp_path, monkeypatch, capsys):
    import json
    import sys

    from benchmarks import projection

    path = tmp_path / "results.json"
    path.write_text(json.dumps({"settings": settings, "summary": {"mt-bench": {"s3d": {"tau": 1.5}}}}))
    monkeypatch.setattr(sys, "argv", ["projection", "--acceptance", str(path), "--out", str(tmp_path)])
    assert message in refused(lambda _: projection.main(), None, capsys)


@pytest.mark.parametrize("flags, message", [
    (["--gammas", "6"], "argument --gammas: invalid value [6]"),  # no 7-token forward is timed to verify it
    (["--gammas", "1,0"], "argument --gammas: invalid value [1, 0]"),
    (["--gammas", "1,x"], "argument --gammas: invalid gamma_list value: '1,x'"),
    (["--methods", "s3d,ar"], "argument --methods: invalid value ['s3d', 'ar']"),  # ar has no draft to time
])
def test_forward_cost_refuses_what_it_does_not_time(flags, message, monkeypatch, capsys):
    import sys

    from benchmarks.research import forward_cost

    monkeypatch.setattr(sys, "argv", ["forward_cost", *flags])
    assert message in refused(lambda _: forward_cost.main(), None, capsys)


@pytest.mark.parametrize("module, flags, message", [
    ("layout_ab", ["--prompts", "0"], "argument --prompts: invalid value 0"),
    ("layout_ab", ["--methods", "ar,fast"], "argument --methods: invalid value ar,fast"),
    ("fold_ab", ["--prompts", "0"], "argument --prompts: invalid value 0"),
    ("fold_ab", ["--datasets", "mt-bench,nope"], "argument --datasets: invalid value mt-bench,nope"),
    ("fold_ab", ["--temperature", "-1"], "--temperature must be >= 0, got -1.0"),
])
def test_in_process_ab_benchmarks_refuse_bad_flags_before_loading(module, flags, message, monkeypatch, capsys):
    import importlib
    import sys

    main = importlib.import_module(f"benchmarks.research.{module}").main
    monkeypatch.setattr(sys, "argv", [module, *flags])
    assert message in refused(lambda _: main(), None, capsys)


def test_quantize_refuses_an_output_it_cannot_create(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert "cannot create --out" in refused(quantize.main, ["--out", str(tmp_path / "file" / "int8")], capsys)


@pytest.mark.parametrize("args, message", [
    (["--dataset", "gsm8k"], "--dataset: invalid value"),
    (["--prompts", "500"], "sharegpt-heldout has only"),
])
def test_search_refuses_bad_input_before_loading(args, message, tmp_path, capsys):
    assert message in refused(search_skip.main, ["--out", str(tmp_path), *args], capsys)


def test_distill_refuses_an_output_it_cannot_create(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert "cannot create --out" in refused(distill.main, ["--out", str(tmp_path / "file" / "d")], capsys)


@pytest.mark.parametrize("overrides, message", [
    (["no_such_key=1"], "unknown training settings ['no_such_key']"),
    (["steps=many"], "training setting steps='many' should be"),
    (["data=/no/such/shards"], "/no/such/shards"),
])
def test_training_refuses_bad_settings_before_loading(overrides, message, tmp_path, capsys):
    argv = ["--config", "configs/train/s3d-smollm2-cpu.yaml", f"out={tmp_path / 'run'}", *overrides]
    assert message in refused(s3d.main, argv, capsys)
