"""The Python API (`s3djax.Generator`) on the real SmolLM2: the command line's output and errors,
one load for every method, and one compile per method."""

import json

import pytest

import s3djax
from infer import generate
from s3djax import cli, weights

PROMPT = "Name three primary colors."
TIMINGS = ("tokens_per_s", "ttft_s", "compile_s", "peak_device_bytes")


@pytest.fixture(scope="module")
def loads():
    """How many times the weights were read by the module's Generator."""
    calls, read = [], weights.from_hf_tensors

    def counted(*args, **kwargs):
        calls.append(1)
        return read(*args, **kwargs)

    mp = pytest.MonkeyPatch()
    mp.setattr(weights, "from_hf_tensors", counted)
    yield calls
    mp.undo()


@pytest.fixture(scope="module")
def gen(loads):
    gen = s3djax.Generator("smollm2-135m", max_cache_len=128, progress=False)
    assert len(loads) == 1
    return gen


def without_timings(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in TIMINGS}


@pytest.mark.parametrize("method, options", [("ar", {}), ("s3d", dict(tree="tree-8", draft_path="none"))])
def test_the_api_gives_the_command_lines_text_and_statistics(gen, method, options, capsys):
    flags = ["--tree", "tree-8", "--draft", "none"] if options else []
    cli.run(lambda: generate.main(["--prompt", PROMPT, "--method", method, "--max-new-tokens", "24",
                                   "--max-cache-len", "128", "--json", *flags]))
    printed, err = capsys.readouterr()
    printed = json.loads(printed.strip().splitlines()[-1])
    out = gen.generate(PROMPT, max_new_tokens=24, method=method, **options)
    assert without_timings(out.json()) == without_timings(printed)
    assert out.method == method and len(out.token_ids) == printed["new_tokens"] and out.tokens_per_s > 0
    if method == "s3d":  # an untrained draft: the statistics of a speculative run, and the CLI's warning
        assert 1.0 <= out.tau <= 5.0 and len(out.acceptance_by_depth) == 4
        assert out.stats["verify_steps"] * 5 >= len(out.token_ids) - 1 > 4
        assert "warning: no trained draft" in err and gen.session(method, **options).warnings


def test_switching_methods_reuses_the_weights_and_the_compiled_steps(gen, loads, compiles):
    read = len(loads)  # the command line's runs in this module read their own
    ar = gen.generate(PROMPT, max_new_tokens=16)
    s3d = gen.generate(PROMPT, max_new_tokens=16, method="s3d", tree="tree-8")
    assert s3d.text == ar.text and len(loads) == read
    before = compiles()
    again = gen.generate(PROMPT, max_new_tokens=16, method="s3d", tree="tree-8")
    assert again.text == ar.text and compiles() == before and again.compile_s == 0.0 and len(loads) == read


def test_streamed_text_adds_up_to_the_generated_text(gen):
    out = gen.generate(PROMPT, max_new_tokens=24, method="s3d")
    stream = gen.stream(PROMPT, max_new_tokens=24, method="s3d", chunk=4)
    pieces = list(stream)
    assert len(pieces) > 2 and "".join(pieces) == out.text
    assert stream.output.token_ids == out.token_ids and stream.output.tau == out.tau


@pytest.mark.parametrize("options, flags", [
    (dict(method="s3d", tree="bush"), ["--method", "s3d", "--tree", "bush"]),
    (dict(method="kangaroo", eta=3.0), ["--method", "kangaroo", "--eta", "3"]),
    (dict(method="s3d", skip="40-50"), ["--method", "s3d", "--skip", "40-50"]),
])
def test_a_bad_option_raises_the_command_lines_message(gen, options, flags, capsys):
    with pytest.raises(s3djax.UserError) as raised:
        gen.generate(PROMPT, max_new_tokens=8, **options)
    with pytest.raises(SystemExit):
        cli.run(lambda: generate.main(["--prompt", PROMPT, *flags]))
    assert capsys.readouterr().err.strip() == f"error: {raised.value}"


def test_a_prompt_too_long_for_the_cache_is_a_user_error(gen):
    with pytest.raises(s3djax.UserError, match="raise --max-cache-len"):
        gen.generate("word " * 200, max_new_tokens=8)


def test_a_list_of_prompts_is_one_batch_with_each_answer_as_alone(gen, tmp_path, capsys):
    prompts = [PROMPT, "What is 2 + 2?", "Write a haiku about rain."]
    alone = [gen.generate(p, max_new_tokens=20).token_ids for p in prompts]
    outs = gen.generate(prompts, max_new_tokens=20)
    assert [o.token_ids for o in outs] == alone and len({tuple(a) for a in alone}) == 3
    assert all(o.stats["batch"] == 3 and o.stats["batch_tokens_per_s"] > o.tokens_per_s for o in outs)
    # Where nothing measured decides whether a batch drafts (the suite's S3DJAX_DEFAULTS=fixed, and a named tree has no
    # record), a speculative method's batch is the target's own steps: the same answers, no verify steps.
    drafted = gen.generate(prompts, max_new_tokens=20, method="s3d", tree="tree-8")
    assert [o.token_ids for o in drafted] == alone and all(o.method == "ar" and o.tau is None for o in drafted)
    assert drafted[0].stats["batch_drafting"].startswith("a batch takes the target's own steps")
    with pytest.raises(s3djax.UserError):
        gen.generate(prompts, max_new_tokens=20, method="s3d", tree="bush")
    for name, text in (("lines.txt", "\n".join(prompts) + "\n\n"),
                       ("prompts.jsonl", "\n".join(json.dumps({"prompt": p, "id": i}) for i, p in enumerate(prompts)))):
        (tmp_path / name).write_text(text)
        cli.run(lambda: generate.main(["--batch-file", str(tmp_path / name), "--max-new-tokens", "20",
                                       "--max-cache-len", "128", "--json"]))
        printed, err = capsys.readouterr()
        records = [json.loads(line) for line in printed.strip().splitlines()]
        assert [r["text"] for r in records] == [o.text for o in outs] and [r["index"] for r in records] == [0, 1, 2]
        assert "3 prompts" in err and "one batch" in err


@pytest.mark.parametrize("text, message", [("", "has no prompts"), ('{"prompt": 3}\n', 'a "prompt" string'),
                                           ('{"prompt": "a"}\n{oops\n', "line 2: not JSON")])
def test_a_bad_batch_file_is_one_line_and_exit_2(tmp_path, capsys, text, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text(text)
    with pytest.raises(SystemExit) as exited:
        cli.run(lambda: generate.main(["--batch-file", str(path)]))
    err = capsys.readouterr().err.strip()
    assert exited.value.code == 2 and message in err and len(err.splitlines()) == 1
