"""Defaults chosen on the machine at hand: the speed model's choice, the cached step times, the data file."""

import dataclasses
import json
import os
import types

import pytest

from s3djax import defaults, methods, speed_model, user_cache
from s3djax.decode import Runner
from s3djax.errors import UserError
from s3djax.speculative import profile
from tests.tiny import tiny_model

RECORD = {1: {"tau": 1.8, "model_drafts": 1.0}, 2: {"tau": 2.4, "model_drafts": 1.0},
          3: {"tau": 2.7, "model_drafts": 1.0}, 4: {"tau": 2.85, "model_drafts": 1.0}}


def costs(verify: dict, draft: float = 0.004, ar: float = 0.010, error: float = 0.0) -> dict:
    """Step times, and rounds whose comparisons between two depths are off by `error` (`speed_model.comparison_error`):
    the shallowest depth's ratio to `ar` moves by a share d in two of three rounds, every other depth's stays."""
    d = error * 3 ** 0.5 / (1.2533 * 1.4826)
    first = min(verify)
    rounds = {g: [1.0, 1.0 + d, 1.0 - d] if g == first else [1.0, 1.0, 1.0] for g in verify}
    return {"ar": ar, "draft": {g: draft * (1 + g / 8) for g in verify}, "verify": verify, "rounds": rounds}


def test_the_speed_model_picks_the_depth_its_cost_table_makes_fastest():
    # A flat verify (a memory-bound device): deeper pays. A verify that grows with its rows (a CPU whose multi-row
    # forward costs more): a shallow chain. Worked by hand: 2.4 * 10 / (4 * 1.25 + 10.5) = 1.548 at g = 2 against
    # 1.8 * 10 / (4.5 + 10) = 1.241, 2.7 * 10 / (5.5 + 14) = 1.385 and 2.85 * 10 / (6 + 18) = 1.188.
    flat = costs({1: 0.010, 2: 0.010, 3: 0.0102, 4: 0.0104})
    steep = costs({1: 0.010, 2: 0.0105, 3: 0.014, 4: 0.018})
    assert speed_model.best_depth(RECORD, flat)[0] == 4
    g, predicted = speed_model.best_depth(RECORD, steep)
    assert g == 2 and predicted[2] == pytest.approx(2.4 * 0.010 / (0.005 + 0.0105))
    assert max(predicted.values()) == predicted[2] and set(predicted) == {1, 2, 3, 4}
    # Measuring stops once two depths in a row are clearly slower than the best (here 3 and 4), not at one, nor at
    # two within a few percent of it.
    assert speed_model.past_best(predicted) and not speed_model.past_best({g: predicted[g] for g in (1, 2, 3)})
    assert not speed_model.past_best({1: 1.27, 2: 1.20, 3: 1.26})
    # A step that skips the model's draft (lookup drafted it) costs only its verify.
    half = {g: {**r, "model_drafts": 0.5} for g, r in RECORD.items()}
    assert speed_model.speedups(half, steep)[2] == pytest.approx(2.4 * 0.010 / (0.5 * 0.005 + 0.0105))
    # A tie goes to the shallower depth; depths without a cost are not candidates.
    tie = {1: {"tau": 2.0, "model_drafts": 0.0}, 2: {"tau": 2.0, "model_drafts": 0.0}, 7: RECORD[4]}
    assert speed_model.best_depth(tie, costs({1: 0.01, 2: 0.01}))[0] == 1
    with pytest.raises(ValueError):
        speed_model.best_depth(RECORD, costs({9: 0.01}))


def test_a_deeper_chain_is_chosen_only_where_it_predicts_faster_by_more_than_its_comparisons_error():
    # Worked by hand, draft 4 ms * (1 + g / 8), ar 10 ms: 2.4 * 10 / (5 + 9.9) = 1.611 at g = 2, 2.7 * 10 / (5.5 +
    # 11.2) = 1.617 at g = 3, 2.85 * 10 / (6 + 11.6) = 1.619 at g = 4; deeper is 0.5% faster at most.
    flat = {1: 0.0095, 2: 0.0099, 3: 0.0112, 4: 0.0116}
    assert speed_model.best_depth(RECORD, costs(flat))[0] == 4  # timings taken as exact
    # g = 1 predicts 1.8 * 10 / (4.5 + 9.5) = 1.286, 21% below the best: only an error that wide reaches it, and the
    # comparisons of 2 and 3 with 4 are exact here, so nothing less takes them.
    assert speed_model.best_depth(RECORD, costs(flat, error=0.03))[0] == 4
    assert speed_model.best_depth(RECORD, costs(flat, error=0.25))[0] == 1
    shallow = {**costs(flat), "rounds": {1: [1.0, 1.0, 1.0], 2: [1.0, 1.02, 0.98], 3: [1.0, 1.0, 1.0],
                                          4: [1.0, 1.0, 1.0]}}
    assert speed_model.comparison_error(shallow, 2, 4) == pytest.approx(1.2533 * 1.4826 * 0.02 / 3 ** 0.5)
    assert speed_model.best_depth(RECORD, shallow)[0] == 2  # 0.5% below the best, within its 2.1% error
    # The error is of the ratio between two depths round by round: a spell that moves both alike does not widen it.
    spell = {**costs(flat), "rounds": {g: [1.0, 1.3, 1.0] for g in flat}}
    assert speed_model.comparison_error(spell, 2, 4) == 0.0 and speed_model.best_depth(RECORD, spell)[0] == 4
    # Against `ar`'s loop itself (a batch's step, `defaults.batch_choice`): each round's ratio as it is.
    assert speed_model.comparison_error(shallow, 2) == speed_model.comparison_error(shallow, 2, 4)
    # Fewer than two rounds timing both depths: no error to go by.
    assert speed_model.comparison_error({"rounds": {1: [None, 1.0], 2: [1.0, 1.1]}}, 1, 2) == 0.0
    # A steep curve's best is far ahead of its neighbours: a few percent of error leaves it.
    assert speed_model.best_depth(RECORD, costs({1: 0.010, 2: 0.0105, 3: 0.014, 4: 0.018}, error=0.03))[0] == 2


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """A user's cache and an acceptance record for a made-up model; measuring returns `table` and counts calls."""
    monkeypatch.setenv("S3DJAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(defaults.ENV, "measure")
    path = tmp_path / "acceptance.json"
    path.write_text(json.dumps({"s3d": {"artifact": None, "sha256": None, "lookup_switch": 0,
                                        "greedy": {str(g): r for g, r in RECORD.items()}}}))
    monkeypatch.setattr(defaults, "acceptance_path", lambda model: str(path))
    state = types.SimpleNamespace(calls=0, table=costs({1: 0.010, 2: 0.0105, 3: 0.014, 4: 0.018}))

    def measure(method, build, depths, record, prompt=None):
        state.calls += 1
        assert depths == [1, 2, 3, 4] and record == RECORD
        return state.table
    monkeypatch.setattr(defaults, "measure_costs", measure)
    return state


def setting(config="model A", shape=(2, 2)):
    """What a build depends on besides the depth (`built.chosen_depth` reads it off the model and options)."""
    return {"config": config, "weights": [(shape, "float32")]}


def choose(at=None, **kw):
    # Measuring is the fixture's, so the build is never called.
    return defaults.depth("s3d", lambda g: None, at or setting(), model="m", draft_path=None, greedy=True, **kw)


def test_step_times_are_measured_once_per_machine_and_setting_and_cached(machine, monkeypatch, capsys):
    first = choose()
    assert first.depth == 2 and "chosen on this machine" in first.how and machine.calls == 1
    assert "measuring s3d's step times" in capsys.readouterr().err
    assert choose().depth == 2 and machine.calls == 1  # from the cache, silently
    assert capsys.readouterr().err == ""
    # Another model or other weights' shapes are another setting: measured again.
    choose(setting("model B"))
    choose(setting(shape=(2, 3)))
    assert machine.calls == 3
    # Where the measurement is not allowed (a check before the weights are read), the cache or the data file.
    assert choose(setting("model C"), measure=False).costs is None
    assert choose(measure=False).depth == 2 and machine.calls == 3
    # S3DJAX_DEFAULTS=again measures anew; =fixed takes the data file without measuring.
    machine.table = costs({1: 0.010, 2: 0.010, 3: 0.0102, 4: 0.0104})
    monkeypatch.setenv(defaults.ENV, "again")
    assert choose().depth == 4 and machine.calls == 4
    monkeypatch.setenv(defaults.ENV, "fixed")
    assert choose().depth == defaults.fallback("depth", "s3d") and machine.calls == 4
    monkeypatch.setenv(defaults.ENV, "sometimes")
    with pytest.raises(UserError, match="S3DJAX_DEFAULTS"):
        choose()


def test_a_corrupt_or_foreign_cache_is_ignored_with_one_line(machine, capsys):
    file = user_cache.path(defaults.TABLE)
    for text in ("{not json", json.dumps({"k": {"breakeven": 0.3}}), json.dumps([1, 2])):
        os.makedirs(os.path.dirname(file), exist_ok=True)
        with open(file, "w") as f:
            f.write(text)
        calls = machine.calls
        assert choose().depth == 2 and machine.calls == calls + 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len([line for line in err if line.startswith("note: ignoring")]) == 1, err
    with open(file) as f:  # rewritten whole, as a table of step times
        assert all(set(v) >= {"ar", "draft", "verify", "device"} for v in json.load(f).values())


def test_a_record_is_used_only_for_its_own_draft_sampling_and_lookup_switch(machine, tmp_path):
    assert choose().depth == 2
    # Sampled rows were not recorded, nor the lookup switch 2, nor a draft file with a hash.
    assert defaults.depth("s3d", lambda g: None, setting(), model="m", draft_path=None, greedy=False).costs is None
    assert choose(lookup_switch=2).costs is None
    draft = tmp_path / "draft.npz"
    draft.write_bytes(b"one draft")
    record = json.loads(open(defaults.acceptance_path("m")).read())
    record["s3d"]["sha256"] = defaults.file_sha256(str(draft))
    with open(defaults.acceptance_path("m"), "w") as f:
        json.dump(record, f)
    assert defaults.depth("s3d", lambda g: None, setting(), model="m", draft_path=str(draft), greedy=True).depth == 2
    draft.write_bytes(b"another draft")
    assert defaults.depth("s3d", lambda g: None, setting(), model="m", draft_path=str(draft), greedy=True).costs is None


def test_where_nothing_measured_decides_a_drafter_takes_the_depth_its_file_gives(machine, monkeypatch):
    # An autoregressive drafter's shipped file records the max draft measured fastest where it was made: that stands
    # in for the data file's depth, wherever the speed model cannot choose, and the stats line says where it came from.
    fixed = (3, "the draft file's max draft")
    for choice in (choose(lookup_switch=2, fixed=fixed), choose(setting("model B"), measure=False, fixed=fixed)):
        assert choice.depth == 3 and choice.costs is None and choice.how.startswith("the draft file's max draft: ")
    assert choose(fixed=fixed).depth == 2  # a record and step times: the machine's choice
    monkeypatch.setenv(defaults.ENV, "fixed")
    assert choose(fixed=fixed).how == f"the draft file's max draft: {defaults.ENV}=fixed"


def test_loops_are_timed_in_turn_and_every_stretch_is_kept():
    calls = []

    def timer(name, seconds):
        stretches = iter(seconds)
        return lambda: calls.append(name) or next(stretches)
    # A slow spell of the machine in the second round slows both loops, which took turns through it.
    times = {"ar": [], "g": [0.9]}
    profile.take_turns({"ar": timer("ar", [0.020, 0.030, 0.021]), "g": timer("g", [0.026, 0.039, None])}, times, 3)
    assert calls == ["ar", "g"] * 3
    # Appended to what was there; a stretch that found the cache full (None) is kept as None, not a timing.
    assert times == {"ar": [0.020, 0.030, 0.021], "g": [0.9, 0.026, 0.039, None]}
    profile.take_turns({"ar": timer("ar", [])}, times, 0)
    assert calls == ["ar", "g"] * 3  # no rounds left to take: nothing timed


def test_a_step_splits_into_draft_and_verify_by_the_fastest_ar_whenever_it_was_timed():
    steps, drafts = {1: 0.025, 3: 0.030}, {1: 0.008, 3: 0.010}
    # The rest of a step costs no less than ar's: the draft timed alone gives way where it would leave less.
    assert split(steps, drafts, 0.019) == ({1: 0.006, 3: 0.010}, {1: 0.019, 3: 0.020})
    # A later, faster ar gives back what an earlier one took: the split depends on the fastest ar, not the order.
    assert split(steps, drafts, 0.018) == ({1: 0.007, 3: 0.010}, {1: 0.018, 3: 0.020})
    assert split({1: 0.015}, {1: 0.004}, 0.018) == ({1: 0.0}, {1: 0.015})


def split(steps, drafts, ar):
    draft, verify = defaults.split_steps(steps, drafts, ar)
    return ({g: round(v, 6) for g, v in draft.items()}, {g: round(v, 6) for g, v in verify.items()})


@pytest.fixture
def short_timing(monkeypatch):
    """The measurement as it runs, in fewer and shorter stretches: what is checked is what it measures."""
    monkeypatch.setattr(defaults, "STRETCH", 8)
    monkeypatch.setattr(defaults, "ROUNDS", 3)


def test_measuring_times_each_depths_own_loop_round_robin_on_a_real_model(short_timing, monkeypatch):
    m = tiny_model()
    m = dataclasses.replace(m, tokenizer=types.SimpleNamespace(pad_token_id=0))
    made, calls = [], []

    def labelled(*args, **kw):  # the loops in the order they were made: `ar`'s, then depth 1's, then depth 3's
        timer, label = timer_of(*args, **kw), len(made)
        made.append(label)
        return lambda: calls.append(label) or timer()
    timer_of = defaults.loop_timer
    monkeypatch.setattr(defaults, "loop_timer", labelled)

    def build(g):
        return methods.build("s3d", m, max_cache_len=defaults.CACHE_LEN, draft_path="none", gamma=g, lookup=1)
    measured = defaults.measure_costs("s3d", build, [1, 3], prompt=list(range(5, 25)))
    # A round as each depth joins, then rounds of all until the last has ROUNDS (3).
    assert calls == [0, 1] + [0, 1, 2] * 3
    assert set(measured) == {"ar", "draft", "verify", "rounds"}
    assert set(measured["draft"]) == set(measured["verify"]) == {1, 3}
    assert all(0 < s < 1 for s in [measured["ar"], *measured["draft"].values(), *measured["verify"].values()])
    # Depth 3 joined in the second round, and each round's stretches are ratios to `ar`'s.
    assert measured["rounds"][3][0] is None and all(0 < r < 100 for r in measured["rounds"][1])


def test_a_depths_step_is_its_median_ratio_to_ars_stretch_of_the_same_round():
    # Round 2 is a slow spell for every loop; depth 2 joined in round 2; `ar` found its cache full in round 4 (None).
    times = {"ar": [0.020, 0.030, 0.021, None], 1: [0.026, 0.036, 0.027, 0.030], 2: [None, 0.039, 0.030, 0.031]}
    costs = defaults.round_robin_costs(times, {1: 0.004, 2: 0.005})
    assert costs["ar"] == 0.020  # the fastest of `ar`'s stretches
    # Depth 1's ratios 1.3, 1.2 and 1.2857 (median 1.2857); depth 2's 1.3 and 1.4286 (median 1.3643), times 20 ms.
    steps = {g: costs["draft"][g] + costs["verify"][g] for g in (1, 2)}
    assert steps == {1: pytest.approx(0.020 * 0.027 / 0.021), 2: pytest.approx(0.010 * (1.3 + 0.030 / 0.021))}
    assert costs["draft"] == {1: 0.004, 2: 0.005}
    assert costs["rounds"] == {1: [pytest.approx(1.3), pytest.approx(1.2), pytest.approx(0.027 / 0.021), None],
                               2: [None, pytest.approx(1.3), pytest.approx(0.030 / 0.021), None]}
    # Their comparison's error: the two depths' ratio in rounds 2 and 3 (0.9231, 0.9), its median's standard error from
    # the median absolute deviation (1.24%), 1.2533 * 1.4826 * 0.0124 / sqrt(2).
    d = 1 - 0.9 / ((0.9 + 0.036 / 0.039) / 2)
    assert speed_model.comparison_error(costs, 1, 2) == pytest.approx(1.2533 * 1.4826 * d / 2 ** 0.5)


@pytest.mark.parametrize("method", ["self-spec", "kangaroo", "s2d"])
def test_an_autoregressive_drafters_max_draft_is_measured_as_a_depth(method, short_timing):
    m = dataclasses.replace(tiny_model(), tokenizer=types.SimpleNamespace(pad_token_id=0))

    def build(g):
        return methods.build(method, m, max_cache_len=defaults.CACHE_LEN, draft_path="none", max_draft=g, lookup=1)
    measured = defaults.measure_costs(method, build, [1, 2])
    assert set(measured["draft"]) == set(measured["verify"]) == {1, 2}
    # Each depth's step, its draft timed alone and taken out of it (`split_steps`).
    assert all(0 <= measured["draft"][g] < measured["draft"][g] + measured["verify"][g] < 1 for g in (1, 2))


@pytest.mark.slow
def test_greedy_s3d_and_lookup_equal_ar_at_the_depths_the_speed_model_chooses(smollm2, tmp_path, monkeypatch):
    # The shipped record (configs/acceptance/smollm2-135m.json) with step times that make these depths fastest, each
    # another than the data file's or the shipped drafter file's.
    monkeypatch.setenv("S3DJAX_CACHE", str(tmp_path))
    drafters = {"self-spec": 3, "kangaroo": 3, "s2d": 2}
    monkeypatch.setenv(defaults.ENV, "fixed")
    for method, depth in drafters.items():  # where nothing is measured, the file's max draft, as before
        built = methods.build(method, smollm2, max_cache_len=256)
        assert built.decoder.drafter.tree.depth != depth and "the draft file's max draft" in built.draft, built.draft
    monkeypatch.setenv(defaults.ENV, "measure")
    target = {"s3d": 6, "lookup": 5, **drafters}
    from s3djax.speculative import gate
    from s3djax.tokenizer import encode_prompt

    def measure(method, build, depths, record, prompt):
        assert prompt == encode_prompt(smollm2.tokenizer, gate.PROMPT, False)  # the model's own text, not made up
        return {"ar": 0.01, "draft": {g: 0.0 for g in depths},
                "verify": {g: 0.01 if g == target[method] else 1.0 for g in depths}, "rounds": {}}
    monkeypatch.setattr(defaults, "measure_costs", measure)

    ids = encode_prompt(smollm2.tokenizer, "List three facts about the Moon, then repeat them.", chat_template=True)
    ar = methods.build("ar", smollm2, max_cache_len=256)
    expected = Runner(ar.decoder, ar.params).generate(ids, 40).tokens
    for method, depth in target.items():
        built = methods.build(method, smollm2, max_cache_len=256)
        assert built.decoder.drafter.tree.depth == depth and "chosen on this machine" in built.draft, built.draft
        if method not in drafters:  # their outputs at every depth: tests/test_self_spec.py and the others
            assert Runner(built.decoder, built.params).generate(ids, 40).tokens == expected, method
    # An option that changes what a drafter drafts leaves its record behind: the plan's or the file's depth, unchosen.
    for method, options, depth in (("self-spec", {"skip": "13"}, 12), ("kangaroo", {"eta": 0.5}, 2),
                                   ("s2d", {"thresholds": "0.5,0.5"}, 1)):
        built = methods.build(method, smollm2, max_cache_len=256, **options)
        assert built.decoder.drafter.tree.depth == depth and "chosen on this machine" not in built.draft, method


def test_a_batch_drafts_only_where_the_speed_model_predicts_it_beats_ars_batch(machine, monkeypatch, capsys):
    m = dataclasses.replace(tiny_model(), tokenizer=types.SimpleNamespace(pad_token_id=0))
    built, ar = (methods.build(name, m, max_cache_len=512, **kw)
                 for name, kw in (("s3d", dict(draft_path="none", gamma=2, lookup=0)), ("ar", {})))
    spec, plain = Runner(built.decoder, built.params), Runner(ar.decoder, ar.params)
    # A depth that commits far more than a batch's step costs drafts; one committing less than a token does not.
    sure = defaults.Choice(2, "chosen", record={2: {"tau": 50.0, "model_drafts": 1.0}}, key="setting")
    text = lambda: [5, 3, 7, 1, 9, 2]  # noqa: E731
    drafts, how = defaults.batch_choice("s3d", sure, spec, plain, 4, text)
    assert drafts and how.startswith("a batch of 4 drafts: drafting predicted")
    assert "measuring s3d's step times in a batch of 4" in capsys.readouterr().err
    poor = dataclasses.replace(sure, record={2: {"tau": 0.5, "model_drafts": 1.0}})
    assert defaults.batch_choice("s3d", poor, spec, plain, 4, text)[0] is False
    assert capsys.readouterr().err == ""  # the batch's step times came from the cache
    entry = next(iter(json.load(open(user_cache.path(defaults.BATCH_TABLE))).values()))
    # Both loops taken in turn ROUNDS times, the step (its whole, every step drafting) a median ratio to `ar`'s.
    assert entry["rows"] == 4 and 0 < entry["ar"] < entry["verify"]["2"] < 1 and entry["draft"] == {"2": 0.0}
    assert len(entry["rounds"]["2"]) == defaults.ROUNDS
    # Where nothing measured decides (no record for the depth built, S3DJAX_DEFAULTS=fixed): the target's own steps.
    assert defaults.batch_choice("s3d", None, spec, plain, 4, text)[0] is False
    assert defaults.batch_choice("s3d", dataclasses.replace(sure, record={3: sure.record[2]}), spec, plain, 4,
                                 text)[0] is False
    monkeypatch.setenv(defaults.ENV, "fixed")
    assert defaults.batch_choice("s3d", sure, spec, plain, 4, text) == (
        False, "a batch takes the target's own steps: nothing measured for a batch of this method")


def test_the_tune_table_gives_each_depths_error_against_the_best():
    from infer.tune import table

    measured = costs({1: 0.010, 2: 0.0105, 3: 0.014, 4: 0.018}, error=0.03)
    g, predicted = speed_model.best_depth(RECORD, measured)
    rows = table("s3d", {"greedy": defaults.Choice(g, "chosen", predicted, measured, RECORD, "k")})
    assert rows[2] == f"| 1 | 4.5 | 10.0 | {predicted[1]:.2f}x (3.0%) |"  # 3% off in its comparison with 2, the best
    assert rows[3] == f"| 2 | 5.0 | 10.5 | **{predicted[2]:.2f}x** |"  # chosen, and the best: nothing to compare
