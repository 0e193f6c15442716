"""The skip-plan search: a few trials on a tiny random model write a valid plan, resume counts what is
done, and every candidate runs in one compiled decoder that decodes exactly as the frozen plan does."""

import dataclasses
import json
import os

import pytest
import yaml

from s3djax.loading import LoadedModel
from s3djax.skip_plan import SkipPlan
from s3djax.speculative.drafters.self_spec import AdaptiveThreshold, load_plan
from tiny import LLAMA, random_params
from train import search_skip
from train.search_skip import Evaluator, SearchConfig

PROMPTS = [[5, 9, 2], [3, 1, 4, 1, 5, 9, 2, 6], list(range(40, 52))]
# A random model is never confident: a zero threshold that stays zero makes it draft every depth.
CFG = SearchConfig(trials=4, max_new_tokens=12, max_draft=3, finalists=2, repeats=1,
                   threshold=AdaptiveThreshold(initial=0.0, step=0.0))


@pytest.fixture(scope="module")
def tiny():
    return LoadedModel("tiny", LLAMA, random_params(LLAMA, 0), None, 0.0)


@pytest.fixture(scope="module")
def evaluator(tiny):
    """Shared by the tests only to compile each decoder once (a search builds its own)."""
    return Evaluator(tiny, PROMPTS, CFG)


def test_search_writes_a_valid_plan_and_resumes(tiny, evaluator, tmp_path):
    out = str(tmp_path / "run")
    ev = evaluator
    first = search_skip.search(tiny, PROMPTS, out, dataclasses.replace(CFG, trials=2), progress=False, evaluator=ev)
    assert first["ran"] == 2
    import optuna
    from optuna.trial import TrialState

    # A process killed mid-trial leaves it running in the journal: the resumed run fails it and goes on.
    optuna.load_study(study_name=search_skip.STUDY, storage=search_skip.journal(out)).ask()
    result = search_skip.search(tiny, PROMPTS, out, CFG, progress=False, dev_set={"dataset": "test"}, evaluator=ev)
    assert result["ran"] == 2  # the journal held 2 finished, so the resumed run ran only the other 2
    study = optuna.load_study(study_name=search_skip.STUDY, storage=search_skip.journal(out))
    assert [t.state for t in study.trials].count(TrialState.COMPLETE) == 4
    assert [t.state for t in study.trials].count(TrialState.FAIL) == 1
    lines = [json.loads(line) for line in open(os.path.join(out, "trials.jsonl"))]
    assert [r["trial"] for r in lines] == [0, 1, 3, 4]
    # The hand-made seed plans go first.
    assert lines[0]["skip"] == search_skip.seed_plans(LLAMA.num_layers)[0].spec()

    plan, record = load_plan(result["path"], LLAMA.num_layers)
    assert plan == result["plan"] and not plan.is_full and record["max_draft"] == CFG.max_draft  # the depth it searched at
    meta = yaml.safe_load(open(result["path"]))
    assert meta["trials"] == 4 and meta["ar_ms_per_token"] > 0 and meta["ms_per_token"] > 0
    assert meta["dev_set"]["dataset"] == "test" and meta["dev_set"]["prompts"] == len(PROMPTS)
    assert "jax" in meta and "device" in meta and meta["tau"] >= 1


def test_traced_plan_decodes_as_the_static_plan_and_compiles_once(tiny, evaluator, compiles):
    ev = evaluator
    ev.warm_up()
    ar = ev.measure(ev.ar)["outputs"]
    before = compiles()
    plans = [SkipPlan.parse(s, LLAMA.num_layers) for s in ("1-2", "0.attn,2.mlp,3.attn")]
    traced = [ev.measure(ev.spec, plan) for plan in plans]
    assert compiles() == before  # two candidates, no new executable
    for got in traced:
        assert got["outputs"] == ar  # lossless
    # The frozen form of the first (each frozen plan costs a compile) decodes step for step alike.
    static = ev.static_runner(plans[0])
    ev.spec.params = (tiny.params, search_skip.flags(plans[0]))
    for prompt in PROMPTS:
        s, t = static.generate(prompt, CFG.max_new_tokens), ev.spec.generate(prompt, CFG.max_new_tokens)
        assert s.tokens == t.tokens
        assert s.stats["accepted_per_step"] == t.stats["accepted_per_step"]  # the same drafts accepted
    assert any(r["tau"] > 1 for r in traced)  # something was accepted: the draft path was exercised


def test_plan_encoding_round_trips_and_refuses_skipping_everything():
    plan = SkipPlan.parse("0.attn,2-3.mlp", 4)
    assert search_skip.plan_of(search_skip.params_of(plan), 4) == plan
    with pytest.raises(Exception, match="skips every sub-layer"):
        search_skip.plan_of({f"{p}_{i}": "skip" for p in ("attn", "mlp") for i in range(4)}, 4)
    assert all(not p.is_full for p in search_skip.seed_plans(30))


def test_cli_rejects_bad_flags(capsys):
    for flags in (["--trials", "0"], ["--max-draft", "0"], ["--dataset", "nope"]):
        with pytest.raises(SystemExit) as e:
            search_skip.main(["--out", "/tmp/unused", *flags])
        assert e.value.code == 2
        assert capsys.readouterr().err.count("\n") == 1
