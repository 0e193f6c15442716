"""Each method's defaults: chosen on the machine at hand where the speed model can decide, else from one data file.

- **Chain depth** (s3d's gamma; lookup's, self-spec's, kangaroo's and s2d's max draft): `speed_model` pairs what
  each depth commits, recorded per shipped draft on held-out prompts (configs/acceptance/MODEL.json, written by
  `train.acceptance`), with each depth's step times measured here: the first time a method runs on a machine (one
  line says so), then cached per machine, model and setting in the user's cache (`step-times.json`).
  `python -m infer.tune` measures on purpose.
- **Everything else**, and the depth where it cannot be measured (no record for the draft in use, `--tree`, or
  S3DJAX_DEFAULTS=fixed): configs/defaults.yaml, by backend, or the max draft a method's shipped file
  records. docs/defaults.md says where each value was measured.

S3DJAX_DEFAULTS: `measure` (the default), `again` (measure anew) or `fixed` (the data file alone).
Flags always override.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import json
import os
import sys

import jax
import jax.numpy as jnp
import yaml

from s3djax import device, speed_model, user_cache
from s3djax.errors import UserError
from s3djax.registry import CONFIG_DIR

ENV = "S3DJAX_DEFAULTS"
MODES = ("measure", "again", "fixed")
TABLE = "step-times.json"
# Step times are measured at this cache (`measure_costs`); a draft step alone, in a compiled loop of this many (in
# shorter loops a step timed slower); where a model has no tokenizer to read the timing text, on a made-up context
# this many tokens long.
CACHE_LEN, DRAFT_REPEATS, CONTEXT = 2048, 16, 256
# A loop is timed in stretches of this many tokens decoded after the timing text (`gate.prompt_ids`), each from the
# same state, in this many rounds in turn with the loops it is weighed against (`measure_costs`, `batch_choice`): on
# a made-up context a depth's steps drafted unlike a text's and timed a quarter off, and stretches one after another
# spread by what they decoded (docs/defaults.md).
STRETCH, ROUNDS = 48, 5
# Bumped where what is measured changes, so that step times measured otherwise are measured anew: 2, each depth's own
# decode loop (before, its draft and verify steps apart, in loops of their own that left out the loop's work); 3, S3D's
# and S2D's drafts with their adapters folded into their int8 copies (`draft_weights.folded`), cheaper steps; 4, the
# spread of the timings kept beside them (`speed_model.best_depth`'s tolerance); 5, `ar` timed in turn with each depth
# (`measure_costs`), its fastest stretch of all kept; 7, on the timing text, each stretch from the same state, every
# depth's loop and `ar`'s round robin, a depth's step its median ratio to `ar`'s in the same round (6 was the first
# two alone, tried and not kept: benchmarks/results/zen4-timing-text-cpu-2026-12-02).
COSTS_VERSION = 7


@functools.cache
def _fallback() -> dict:
    with open(os.path.join(CONFIG_DIR, "defaults.yaml")) as f:
        return yaml.safe_load(f)


def fallback(name: str, method: str | None = None):
    """configs/defaults.yaml's `name` (for `method`, where it is per method) on this backend."""
    entry = _fallback()[name]
    if method is not None:
        entry = entry.get(method, {})
    return entry.get(jax.default_backend(), entry.get("other")) if isinstance(entry, dict) else entry


def mode() -> str:
    value = (os.environ.get(ENV) or "measure").lower()
    if value not in MODES:
        raise UserError(f"{ENV}={value!r}; choose from {', '.join(MODES)}")
    return value


def depth_options(method: str, g: int) -> dict:
    """Build options for `method` at chain depth g."""
    return {speed_model.DEPTH_OPTION[method]: g}


# ------------------------------------------------------------------------------ what each depth commits

def acceptance_path(model: str) -> str:
    return os.path.join(CONFIG_DIR, "acceptance", f"{model}.json")


def read_acceptance(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def write_acceptance(path: str, table: dict) -> None:
    user_cache.write_json(path, table)


def file_sha256(path: str) -> str:
    """The file's SHA-256, read once per version of the file in a process (a draft is about 19 MB; every s3d build
    asks)."""
    st = os.stat(path)
    return _sha256(os.path.abspath(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=32)
def _sha256(path: str, mtime_ns: int, size: int) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def acceptance_record(model: str, method: str, draft_path: str | None, greedy: bool,
                      lookup_switch: int = 0) -> dict | None:
    """{g: {tau, model_drafts}} recorded for `method` with the draft file in use (None for lookup, which has
    none) and this lookup switch, greedy or sampled; None where nothing was recorded for that setting."""
    path = acceptance_path(model)
    if not os.path.isfile(path):
        return None
    entry = read_acceptance(path).get(method)
    if not entry:
        return None
    if entry.get("sha256") and (draft_path is None or not os.path.isfile(draft_path)
                                or file_sha256(draft_path) != entry["sha256"]):
        return None  # another draft than the one recorded
    if entry.get("lookup_switch", 0) != lookup_switch:
        return None
    rows = entry.get("greedy" if greedy else "sampled")
    return {int(g): r for g, r in rows.items()} if rows else None


# ------------------------------------------------------------------------------ what each depth costs here

def _key(method: str, setting: dict) -> str:
    """The machine (CPU or GPU, jax), the method and its `setting` (model, weights' shapes and dtypes, options but the
    depth), and the CPU matmul's blocking: what the step times depend on."""
    from cpu_kernels import matmul

    blocking = matmul.blocking()
    text = json.dumps([COSTS_VERSION, device.describe(), method, setting] + ([blocking] if blocking else []),
                      sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _valid(entry) -> bool:
    return (all(isinstance(entry.get(k), dict) for k in ("draft", "verify", "rounds"))
            and isinstance(entry.get("ar"), float))


def _as_costs(entry: dict) -> dict:
    return {"ar": entry["ar"], **{k: {int(g): s for g, s in entry[k].items()} for k in ("draft", "verify", "rounds")}}


def measure_costs(method: str, build, depths: list[int], record: dict | None = None,
                  prompt: list[int] | None = None) -> dict:
    """Seconds per step at each depth on this machine, {"ar": s, "draft": {g: s}, "verify": {g: s}, "rounds": ...},
    timed in the compiled decode loops a run uses, so that the loop's own work counts as a run pays it: "ar" a step
    of `ar`'s loop; "draft" the model's draft alone, and "verify" the rest of a step of depth g's own loop drafting by
    the model: verification and the loop's work (a step drafted by prompt lookup instead costs about that). The loops
    take turns round robin, a stretch each a round, a depth joining in the round after it is built, until every depth
    has ROUNDS rounds (`round_robin_costs` says what is kept). `build(g)` returns the method built at depth g as it
    will run. With the `record` of what each depth commits, the depths stop where the speed model finds two in a row
    slower than the best (`speed_model.past_best`). `prompt`: the timing text's ids (`gate.prompt_ids`), where the
    model can read it."""
    from s3djax.decode import Runner
    from s3djax.speculative.profile import ms_per_step, step_functions, take_turns

    prompt = list(prompt) if prompt else [(7 * i) % 1000 + 100 for i in range(CONTEXT)]
    timers, times, drafts = {}, {}, {}
    for g in sorted(depths):
        built = build(g)
        if not timers:
            timers["ar"], times["ar"] = loop_timer(Runner(built.decoder.ar, built.params[0]), prompt), []
        drafter, runner = built.decoder.drafter, Runner(built.decoder, built.params)

        def by_the_model():  # a fresh state whose steps all draft by the model
            state = runner.prefill(prompt)
            return state if drafter.force is None else {**state, "drafter": drafter.force(state["drafter"], False)}
        timers[g], times[g] = loop_timer(runner, prompt, by_the_model(), "iteration"), [None] * len(times["ar"])
        drafts[g] = 0.0
        if method != "lookup":  # lookup drafts by a search, not a model
            state, draft_step = by_the_model(), step_functions(built.decoder)["draft_step_ms"]
            drafts[g] = ms_per_step(lambda p, c: draft_step(p, c, state["length"], state["last"]), built.params,
                                    (state["cache"], state["drafter"]), DRAFT_REPEATS)[0] / 1e3
        take_turns(timers, times)
        if record and speed_model.past_best(speed_model.speedups(record, round_robin_costs(times, drafts))):
            break
    take_turns(timers, times, ROUNDS - sum(t is not None for t in times[g]))
    return round_robin_costs(times, drafts)


def round_robin_costs(times: dict, drafts: dict) -> dict:
    """`measure_costs`'s result from each loop's seconds a step round by round, {"ar": [s], g: [s]} (None where a
    loop was not timed that round), and each depth's draft timed alone. A depth's step is its median ratio to `ar`'s
    stretch of the same round, times `ar`'s fastest stretch: on a shared machine the loops run in spells a few
    stretches long, and a ratio within a round carries less of a spell than either timing. The ratios are kept,
    "rounds": {g: [ratio]}, for the error of a comparison between two depths (`speed_model.comparison_error`)."""
    import statistics

    ar = min(t for t in times["ar"] if t)
    rounds = {g: [t / a if t and a else None for t, a in zip(times[g], times["ar"])] for g in drafts}
    steps = {g: ar * statistics.median(r for r in rounds[g] if r) for g in drafts}
    draft, verify = split_steps(steps, drafts, ar)
    return {"ar": ar, "draft": draft, "verify": verify, "rounds": rounds}


def split_steps(steps: dict, drafts: dict, ar: float) -> tuple[dict, dict]:
    """({g: draft}, {g: verify}) from each depth's whole step and its model's draft timed alone: the rest of a step
    verifies at least one token, so it costs no less than the target's own step `ar`, and the draft gives way."""
    draft = {g: max(min(drafts[g], steps[g] - ar), 0.0) for g in steps}
    return draft, {g: steps[g] - draft[g] for g in steps}


def loop_timer(runner, prompt: list[int], state: dict | None = None, counter: str = "step",
               tokens: int | None = None):
    """A function timing one more stretch of `tokens` (STRETCH) tokens of `runner`'s compiled decode loop on
    `prompt`'s cache (or from `state`, its prefill): seconds per step as `counter` counts them. A first stretch warms
    it up. Every stretch starts from that state (a copy), decoding the same text, so that stretches differ by the
    machine's noise alone, not by what they decode."""
    from s3djax.speculative.gate import stretch

    tokens = tokens or STRETCH
    start = jax.block_until_ready(jax.tree.map(jnp.copy, runner.prefill(prompt) if state is None else state))
    decode = runner._compiled("decode", runner.decoder.decode, start, jnp.int32(0))[0]

    def once(n: int = tokens) -> float | None:
        fresh = jax.block_until_ready(jax.tree.map(jnp.copy, start))  # the loop donates what it is given
        # What is decoded is never shown, so an EOS does not end the timing.
        _, steps, seconds = stretch(decode, runner.params, {**fresh, "done": jnp.zeros_like(fresh["done"])}, n, counter)
        return seconds / steps if steps else None
    once(4)
    return once


def step_costs(method: str, build, depths: list[int], setting: dict, *, measure: bool,
               record: dict | None = None, prompt_ids=None) -> dict | None:
    """The cached step times for this machine and setting, else measured now (one line says so) where `measure`, as
    far as `record` says deeper depths stop paying (`measure_costs`, on `prompt_ids()` where given); None where
    neither."""
    k = _key(method, setting)
    table = user_cache.read_table(TABLE, _valid)
    if k in table and mode() != "again":
        return _as_costs(table[k])
    if not measure:
        return None
    print(f"measuring {method}'s step times on this machine to choose its depth (once)...", file=sys.stderr,
          flush=True)
    costs = measure_costs(method, build, depths, record, prompt=prompt_ids() if prompt_ids else None)
    table[k] = {**costs, "method": method, "device": device.describe(), "date": datetime.date.today().isoformat()}
    user_cache.write_table(TABLE, table)
    return costs


@dataclasses.dataclass(frozen=True)
class Choice:
    depth: int
    how: str                             # for the stats line
    predicted: dict | None = None        # {g: predicted speedup against ar}
    costs: dict | None = None            # step times measured here
    record: dict | None = None           # {g: {tau, model_drafts}}: what each depth commits
    key: str | None = None               # the step times' cache key: the machine, method and setting


def depth(method: str, build, setting: dict, *, model: str, draft_path: str | None, greedy: bool,
          lookup_switch: int = 0, measure: bool = True, fixed: tuple[int, str] | None = None,
          prompt_ids=None) -> Choice:
    """The chain depth for `method`: the speed model's best where a record and this machine's step times exist
    (measuring them once where `measure`), else `fixed`, (depth, where it comes from), by default the data file's.
    `build(g)`: the method built at depth g with everything else as it will run, its model draft always running;
    `setting`: what that build depends on besides the depth, the step times' cache key; `prompt_ids()`: the timing
    text's ids (None: a made-up context)."""
    g_fixed, source = fixed or (fallback("depth", method), "configs/defaults.yaml")
    if mode() == "fixed":
        return Choice(g_fixed, f"{source}: {ENV}=fixed")
    record = acceptance_record(model, method, draft_path, greedy, lookup_switch)
    if record is None:
        return Choice(g_fixed, f"{source}: no acceptance record for this draft")
    costs = step_costs(method, build, sorted(record), setting, measure=measure, record=record, prompt_ids=prompt_ids)
    if costs is None:
        return Choice(g_fixed, f"{source}: step times not measured yet")
    g, predicted = speed_model.best_depth(record, costs)
    top = max(predicted, key=predicted.get)
    within = (f" (depth {top} {predicted[top]:.2f}x, within the timings' "
              f"{speed_model.comparison_error(costs, g, top):.1%} error)"
              if top != g else "")
    return Choice(g, f"chosen on this machine, predicted {predicted[g]:.2f}x ar{within}", predicted, costs, record,
                  _key(method, setting))


# ------------------------------------------------------------------------------ whether a batch drafts

BATCH_TABLE = "batch-step-times.json"
# 2: timed on real text, the continuation of a prompt; 3: each stretch from the same state; 4: the step a median ratio
# to `ar`'s in the same round, and its error the tolerance, as a depth's (`round_robin_costs`)
BATCH_VERSION = 4


def batch_choice(method: str, chosen: Choice | None, spec, ar, rows: int, prompt_ids, *,
                 measure: bool = True) -> tuple[bool, str]:
    """(whether a batch of `rows` prompts drafts, why): a step of every row costs more than one row's, and `ar`'s
    batch reads its weights once for all rows, so drafting pays less in a batch (docs/sampling.md#batches). The speed
    model weighs it as at one row: what the chosen depth commits a row (its record) against the step times of both
    loops at `rows` rows, timed here in turn (`spec` and `ar`: the method's and the target's Runners as the batch
    will run them) on the text they decode after `prompt_ids()` (a made-up context mis-timed the steps by a quarter,
    docs/sampling.md#batches), once per machine and setting (`batch-step-times.json`). It drafts where that predicts
    it faster than `ar` by more than that comparison's error (`speed_model.comparison_error`); where nothing measured
    decides, a batch takes the target's own steps."""
    g = spec.decoder.drafter.tree.depth  # the depth the method was built with
    if mode() == "fixed" or chosen is None or not chosen.record or g not in chosen.record or chosen.key is None:
        return False, "a batch takes the target's own steps: nothing measured for a batch of this method"
    k = _key(method, {"depth": chosen.key, "g": g, "rows": rows, "cache": spec.decoder.max_cache_len,
                      "version": BATCH_VERSION})
    table = user_cache.read_table(BATCH_TABLE, _valid)
    if k not in table or mode() == "again":
        if not measure:
            return False, "a batch takes the target's own steps: its step times not measured yet"
        print(f"measuring {method}'s step times in a batch of {rows} on this machine (once)...", file=sys.stderr,
              flush=True)
        from s3djax.decode import Runner
        from s3djax.speculative.profile import take_turns

        prompt, decoder = list(prompt_ids()), spec.decoder.for_rows(rows)
        batch = Runner(decoder, spec.params)
        state = batch.prefill(prompt, rows=rows)
        if decoder.drafter.force is not None:  # every step drafts by the model, as at one row (`measure_costs`)
            state = {**state, "drafter": decoder.drafter.force(state["drafter"], False)}
        timers = {"ar": loop_timer(ar, prompt, ar.prefill(prompt, rows=rows)),
                  g: loop_timer(batch, prompt, state, "iteration")}
        times = {name: [] for name in timers}
        take_turns(timers, times, ROUNDS)
        table[k] = {**round_robin_costs(times, {g: 0.0}), "rows": rows, "method": method,
                    "device": device.describe(), "date": datetime.date.today().isoformat()}
        user_cache.write_table(BATCH_TABLE, table)
    costs = _as_costs(table[k])
    predicted = speed_model.speedups({g: chosen.record[g]}, costs)[g]  # the whole step, every one drafting
    drafts = predicted * (1 - speed_model.comparison_error(costs, g)) > 1.0
    verdict = "drafts" if drafts else "takes the target's own steps"
    return drafts, f"a batch of {rows} {verdict}: drafting predicted {predicted:.2f}x ar's batch on this machine"
