"""The pause gate: steps that draft nothing keep greedy output `ar`'s for every drafter that can pause, and the
breakeven is measured once per machine and decoder, cached, and its cache keyed and checked."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s3djax.decode import ARDecoder, Runner
from s3djax.skip_plan import SkipPlan
from s3djax.speculative import gate, loop
from s3djax.speculative import tree as trees
from s3djax.speculative.draft_params import init_draft
from s3djax.speculative.drafters.kangaroo import KangarooDrafter, init_adapter
from s3djax.speculative.drafters.lookup import LookupDrafter, WithLookup
from s3djax.speculative.drafters.s2d import S2DDrafter
from s3djax.speculative.drafters.s3d import S3DDrafter
from s3djax.speculative.drafters.s3d_in_verify import InVerifyS3DDrafter
from s3djax.speculative.drafters.self_spec import AdaptiveThreshold, SelfSpecDrafter
from s3djax.speculative.loop import PROBE_EVERY, SpecDecoder
from s3djax.tokenizer import encode_chat
from tests.tiny import LLAMA, random_params

CACHE = 256  # room for the measurement's stretches
PLAN = SkipPlan.parse("1-2", LLAMA.num_layers)


def drafters():
    s3d = S3DDrafter(LLAMA, PLAN, trees.TreeSpec.chain(3), 3)
    return {"s3d": s3d, "lookup": LookupDrafter(LLAMA, trees.TreeSpec.chain(3), ngram=2),
            "s3d+lookup": WithLookup(s3d, switch=1, ngram=2),
            "self-spec": SelfSpecDrafter(LLAMA, PLAN, trees.TreeSpec.chain(3), AdaptiveThreshold(initial=0.3)),
            "kangaroo+lookup": WithLookup(KangarooDrafter(LLAMA, trees.TreeSpec.chain(3), exit_layer=1, eta=0.0),
                                          switch=1, ngram=2),
            "s2d+lookup": WithLookup(S2DDrafter(LLAMA, trees.TreeSpec.chain(3), exits=(1, 2)), switch=1, ngram=2)}


def runner(drafter, params, **kw):
    inner = getattr(drafter, "inner", drafter)
    draft = init_draft(params, LLAMA, PLAN) if isinstance(inner, S3DDrafter) else \
        init_adapter(params, LLAMA, inner.exit_layer) if isinstance(inner, KangarooDrafter) else \
        {"thresholds": jnp.asarray([0.1])} if isinstance(inner, S2DDrafter) else {}
    return Runner(SpecDecoder.create(ARDecoder(LLAMA, CACHE, eos_ids=(), **kw), drafter, gate=True), (params, draft))


@pytest.mark.parametrize("name", ["s3d", "lookup", "s3d+lookup", "self-spec", "kangaroo+lookup", "s2d+lookup"])
@pytest.mark.parametrize("breakeven", [float("inf"), 0.5])
def test_pausing_keeps_greedy_output_ars(name, breakeven):
    params = random_params(LLAMA, 0)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3]
    expected = Runner(ARDecoder(LLAMA, CACHE, eos_ids=()), params).generate(prompt, 50).tokens
    spec = runner(drafters()[name], params)
    spec.overrides.update(breakeven=np.float32(breakeven), breakeven_free=np.float32(breakeven))
    got = spec.generate(prompt, 50)
    assert got.tokens == expected
    paused, steps = got.stats["paused_steps"], got.stats["verify_steps"]
    assert paused > 0 and steps > 0
    if breakeven == float("inf") and spec.decoder.drafter.hint is None:  # only probes draft, after 1, 2, 4 ... 8 paused
        waits = np.minimum(2 ** np.arange(64), PROBE_EVERY).cumsum()
        assert steps == np.searchsorted(waits, paused, side="right")
    elif breakeven == float("inf"):  # lookup drafts only after a paused step whose proposal was the target's token
        history = jnp.asarray([prompt + got.tokens])
        hits = sum(bool(spec.decoder.drafter.hint(history, jnp.asarray([end]), history[0, end + 1])[0])
                   for end in range(len(prompt) - 1, history.shape[1] - 1))
        assert steps <= hits


def test_the_mean_acceptance_keeps_a_drafter_that_accepts_well_from_pausing():
    # The running acceptance alone (0) is below the breakeven; a mean of many accepted drafts draws the expected
    # acceptance over it, and with no mean (total 0) the same start pauses.
    params = random_params(LLAMA, 0)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    expected = Runner(ARDecoder(LLAMA, CACHE, eos_ids=()), params).generate(prompt, 30).tokens
    paused = {}
    for total in (1000.0, 0.0):
        spec = runner(drafters()["s3d"], params)
        spec.overrides.update(breakeven=np.float32(0.5), rate=np.float32(0.0), total=np.float32(total))
        got = spec.generate(prompt, 30)
        assert got.tokens == expected
        paused[total] = got.stats["paused_steps"]
    assert paused[1000.0] == 0 and paused[0.0] > 0


def fitted_slope(accepted):
    """The gate's slope after drafting steps that accepted `accepted`, the running acceptance kept as the loop keeps it."""
    return float(loop.slope(gauged(accepted)["fit"], jnp.int32(len(accepted))))


def gauged(accepted):
    """The gate's measures after drafting steps that accepted `accepted`, updated as the loop updates them."""
    g = loop.gauge(3)
    for a in accepted:
        g = loop.recorded(g, jnp.int32(a))
    return g


def test_the_expected_acceptance_follows_the_running_one_as_far_as_acceptance_persists():
    rng = np.random.default_rng(0)
    steady = rng.integers(0, 4, 2000)  # each step's acceptance drawn afresh: misses in a row are noise
    runs = np.repeat(rng.choice([0, 3], 100), 10)  # runs of ten steps that all accept, or none
    assert fitted_slope(steady) < 0.15 and fitted_slope(runs) > 0.6
    # Before MIN_FIT drafting steps, halfway; then a low running acceptance under a steady mean barely moves it.
    assert fitted_slope(runs[:loop.MIN_FIT - 1]) == loop.PRIOR_SLOPE
    g = gauged(steady)
    mean = float(g["total"]) / (len(steady) + 1)
    expected = float(loop.expected_acceptance(jnp.float32(0.0), g["total"], len(steady), g["fit"]))
    assert mean * 0.85 < expected <= mean


def test_a_step_lookup_drafts_is_weighed_by_its_own_breakeven():
    # With no step of the model's paying (breakeven inf), the steps lookup drafts still draft where theirs pays (-inf),
    # and pause where it does not (inf), but for probes: the gate tells the two apart, and output stays ar's.
    params = random_params(LLAMA, 0)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4, 1, 5, 9, 2, 6]
    expected = Runner(ARDecoder(LLAMA, CACHE, eos_ids=()), params).generate(prompt, 40).tokens
    looked_up = {}
    for free in (-np.inf, np.inf):
        spec = runner(drafters()["s3d+lookup"], params)
        spec.overrides.update(breakeven=np.float32(np.inf), breakeven_free=np.float32(free))
        got = spec.generate(prompt, 40)
        assert got.tokens == expected
        looked_up[free] = got.stats["lookup_steps"]
    assert looked_up[-np.inf] > looked_up[np.inf] and looked_up[-np.inf] >= 3


def test_lookups_hint_is_whether_its_proposal_was_the_next_token():
    lookup = LookupDrafter(LLAMA, trees.TreeSpec.chain(3), ngram=2)
    history = jnp.asarray([[5, 6, 7, 1, 5, 6, 0, 0], [5, 6, 7, 1, 2, 3, 0, 0]])
    end = jnp.asarray([5, 5])  # row 0 ends in "5 6", which was followed by 7; row 1's "3" never occurred before
    assert lookup.hint(history, end, jnp.asarray([7, 7])).tolist() == [True, False]
    assert lookup.hint(history, end, jnp.asarray([8, 7])).tolist() == [False, False]


def test_off_the_gate_is_not_compiled_in():
    # The default decoder holds no paused branch: a breakeven no step reaches still drafts every step.
    params = random_params(LLAMA, 0)
    spec = runner(drafters()["s3d"], params)
    spec.decoder = dataclasses.replace(spec.decoder, gate=False)
    spec.overrides["breakeven"] = np.float32(float("inf"))
    stats = spec.generate([3, 1, 4, 1, 5, 9, 2, 6], 20).stats
    assert stats["paused_steps"] == 0 and stats["verify_steps"] > 0


def test_drafters_that_cannot_pause_draft_every_step():
    params = random_params(LLAMA, 0)
    in_verify = InVerifyS3DDrafter(LLAMA, PLAN, trees.TreeSpec.chain(2), 2)  # its chain comes from the last verify
    assert in_verify.pause is None and WithLookup(in_verify).pause is None
    spec = Runner(SpecDecoder.create(ARDecoder(LLAMA, CACHE, eos_ids=()), in_verify),
                  (params, init_draft(params, LLAMA, PLAN)))
    assert gate.tune(spec, lambda: [1, 2, 3], "s3d", choice="on") is None and not spec.overrides


def entry_of(cache_home, spec) -> dict:
    return json.loads(cache_home.read_text())[gate.key(spec.decoder, spec.params)]


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv(gate.ENV, "on")
    return tmp_path / "s3djax" / "step-costs.json"


@pytest.fixture
def measured(monkeypatch):
    calls = []
    real = gate.measure

    def counted(runner, prompt_ids):
        calls.append(1)
        return real(runner, prompt_ids)

    monkeypatch.setattr(gate, "measure", counted)
    return calls


def test_the_breakeven_is_measured_once_and_keyed_by_decoder(cache_home, measured, capsys):
    params, prompt = random_params(LLAMA, 0), lambda: list(range(1, 8))
    first = gate.tune(runner(drafters()["s3d"], params), prompt, "s3d")
    table = json.loads(cache_home.read_text())
    (entry,) = table.values()
    assert entry["breakeven"] == first and entry["draft_s"] > 0 and entry["pause_s"] > 0 and "CPU" in entry["device"]
    assert "measuring when s3d's drafts pay" in capsys.readouterr().err
    again = runner(drafters()["s3d"], params)
    assert gate.tune(again, prompt, "s3d") == first and len(measured) == 1  # read, not measured
    assert float(again.overrides["breakeven"]) == pytest.approx(first)
    gate.tune(runner(drafters()["lookup"], params), prompt, "lookup")  # another decoder: another key
    assert len(measured) == 2 and len(json.loads(cache_home.read_text())) == 2
    # A drafter giving way to lookup: its free steps timed apart, on a prompt whose repeats lookup can draft from.
    mixed = runner(drafters()["s3d+lookup"], params)
    gate.tune(mixed, lambda: [3, 1, 4, 1, 5, 9, 2, 6] * 3, "s3d")
    entry = json.loads(cache_home.read_text())[gate.key(mixed.decoder, mixed.params)]
    assert entry["free_s"] >= 0 and entry["breakeven_free"] == pytest.approx(entry["free_s"] / entry["pause_s"] - 1)
    assert float(mixed.overrides["breakeven_free"]) == pytest.approx(entry["breakeven_free"])
    assert "breakeven_free" not in entry_of(cache_home, again)  # s3d alone has no free steps


def test_a_corrupt_or_foreign_cache_is_ignored_in_one_line(cache_home, measured, capsys):
    params = random_params(LLAMA, 0)
    for text in ("{not json", json.dumps({"k": {"breakeven": "high"}}), json.dumps([1, 2])):
        cache_home.parent.mkdir(parents=True, exist_ok=True)
        cache_home.write_text(text)
        assert gate.tune(runner(drafters()["s3d"], params), lambda: [1, 2, 3, 4], "s3d") is not None
        notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
        assert len(notes) == 1 and "ignoring" in notes[0]
        assert len(json.loads(cache_home.read_text())) == 1  # rewritten whole
    assert len(measured) == 3


def test_the_switch_turns_the_gate_off_or_measures_again(cache_home, measured, monkeypatch):
    params = random_params(LLAMA, 0)
    monkeypatch.setenv(gate.ENV, "off")
    spec = runner(drafters()["s3d"], params)
    assert gate.tune(spec, lambda: [1, 2, 3], "s3d", "on") is None and not spec.overrides and not cache_home.exists()
    monkeypatch.setenv(gate.ENV, "")  # unset: --pause, else configs/defaults.yaml's (on for a CPU)
    assert gate.tune(runner(drafters()["s3d"], params), lambda: [1, 2, 3], "s3d", "off") is None
    assert gate.tune(runner(drafters()["s3d"], params), lambda: [1, 2, 3], "s3d") is not None
    assert gate.tune(runner(drafters()["s3d"], params), lambda: [1, 2, 3], "s3d", "on") is not None  # cached
    monkeypatch.setenv(gate.ENV, "again")
    for _ in range(2):
        gate.tune(runner(drafters()["s3d"], params), lambda: [1, 2, 3], "s3d")
    assert len(measured) == 3


def test_the_key_names_the_machine_and_the_weights_shapes():
    params = random_params(LLAMA, 0)
    decoder = runner(drafters()["s3d"], params).decoder
    assert gate.key(decoder, params) == gate.key(decoder, random_params(LLAMA, 1))  # values do not matter
    assert gate.key(decoder, params) != gate.key(decoder, jax.tree.map(lambda a: a.astype("bfloat16"), params))
    other = runner(S3DDrafter(LLAMA, PLAN, trees.TreeSpec.chain(2), 2), params).decoder
    assert gate.key(decoder, params) != gate.key(other, params)


def test_smollm2_s3d_at_its_measured_gate_equals_ar(smollm2, cache_home):
    # S3D as a CPU runs it, giving way to prompt lookup: both breakevens measured on the real model.
    from s3djax.generator import Generator

    gen = Generator.from_model(smollm2, max_cache_len=128)
    text = "List four planets and one fact about each."
    expected = gen.generate(text, 40).token_ids
    out = gen.generate(text, 40, method="s3d")
    assert out.token_ids == expected
    runner = gen.session("s3d").runner
    assert isinstance(runner.decoder.drafter, WithLookup)
    stored = json.loads(cache_home.read_text())[gate.key(runner.decoder, runner.params)]
    assert float(runner.overrides["breakeven"]) == pytest.approx(stored["breakeven"])
    assert float(runner.overrides["breakeven_free"]) == pytest.approx(stored.get("breakeven_free", stored["breakeven"]))
    chat = gen.chat("s3d")  # a later turn resumes the cache, and the gate's state starts anew
    for turn in ("Name a primary color.", "Now name another one."):
        out = chat.send(turn, 16)
        ids = encode_chat(gen.tokenizer, chat.messages[:-1])
        assert out.token_ids == gen.session("ar").runner.generate(ids, 16).tokens
