"""Each method's defaults: chosen on the machine at hand where the speed model can decide, else from one data file.

- **Chain depth** (s3d's gamma, lookup's max draft): `speed_model` pairs what each depth commits, recorded per
  shipped draft on held-out prompts (configs/acceptance/MODEL.json, written by `train.acceptance`), with each
  depth's step times measured here: the first time a method runs on a machine (one line says so), then cached per
  machine, model and setting in the user's cache (`step-times.json`). `python -m infer.tune` measures on purpose.
- **Everything else**, and the depth where it cannot be measured (no record for the draft in use, `--tree`, or
  S3DJAX_DEFAULTS=fixed): configs/defaults.yaml, by backend. docs/defaults.md says where each value was measured.

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
import time

import jax
import yaml

from s3djax import device, speed_model, user_cache
from s3djax.errors import UserError
from s3djax.registry import CONFIG_DIR

ENV = "S3DJAX_DEFAULTS"
MODES = ("measure", "again", "fixed")
TABLE = "step-times.json"
DEPTH_OPTION = {"s3d": "gamma", "lookup": "max_draft"}  # the option each method's chain depth is
# Step times are measured at this cache, this many tokens in, each compiled loop of REPEATS steps timed ROUNDS times,
# every depth in turn, the fastest kept: another process taking the cores makes a run slower, never faster.
CACHE_LEN, CONTEXT, REPEATS, ROUNDS = 2048, 256, 4, 5


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
    return {DEPTH_OPTION[method]: g}


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
    text = json.dumps([device.describe(), method, setting] + ([blocking] if blocking else []), sort_keys=True,
                      default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _valid(entry) -> bool:
    return all(isinstance(entry.get(k), dict) for k in ("draft", "verify")) and isinstance(entry.get("ar"), float)


def _as_costs(entry: dict) -> dict:
    return {"ar": entry["ar"], **{k: {int(g): s for g, s in entry[k].items()} for k in ("draft", "verify")}}


def measure_costs(method: str, build, depths: list[int]) -> dict:
    """Seconds per step at each depth on this machine: {"ar": s, "draft": {g: s}, "verify": {g: s}}.
    `build(g)` returns the method built at depth g with its model draft always running."""
    from s3djax.decode import Runner
    from s3djax.speculative.profile import compiled_loop, step_functions

    prompt = [(7 * i) % 1000 + 100 for i in range(CONTEXT)]
    runs, carries = {}, {}  # (name, g) -> (compiled loop, params); g -> the carry depth g's loops pass on
    for g in depths:
        built = build(g)
        state = Runner(built.decoder, built.params).prefill(prompt)
        length, last = state["length"], state["last"]
        carry = (state["cache"], state["drafter"])
        for name, step in step_functions(built.decoder).items():
            if name == "ar_step_ms" and runs:
                continue
            key = {"ar_step_ms": "ar", "draft_step_ms": "draft", "verify_step_ms": "verify"}[name]
            if key == "draft" and method == "lookup":
                continue  # lookup drafts by a search, no forward: its cost is left out, as the model's share is 0
            run, carry = compiled_loop(lambda p, c, step=step, length=length, last=last: step(p, c, length, last),
                                       built.params, carry, REPEATS)
            runs[key, g] = (run, built.params)
        carries[g] = carry
        del state
    best = {}
    for _ in range(ROUNDS):
        for (k, g), (run, params) in runs.items():
            t = time.perf_counter()
            carries[g], acc = run(params, carries[g])
            jax.block_until_ready(acc)
            best[k, g] = min(best.get((k, g), float("inf")), (time.perf_counter() - t) / REPEATS)
    costs = {"ar": best["ar", depths[0]], "draft": {}, "verify": {}}
    for (k, g), s in best.items():
        if k != "ar":
            costs[k][g] = s
    if method == "lookup":
        costs["draft"] = {g: 0.0 for g in depths}
    return costs


def step_costs(method: str, build, depths: list[int], setting: dict, *, measure: bool) -> dict | None:
    """The cached step times for this machine and setting, else measured now (one line says so) where `measure`;
    None where neither."""
    k = _key(method, setting)
    table = user_cache.read_table(TABLE, _valid)
    if k in table and mode() != "again":
        return _as_costs(table[k])
    if not measure:
        return None
    print(f"measuring {method}'s step times on this machine to choose its depth (once)...", file=sys.stderr,
          flush=True)
    costs = measure_costs(method, build, depths)
    table[k] = {**costs, "method": method, "device": device.describe(), "date": datetime.date.today().isoformat()}
    user_cache.write_table(TABLE, table)
    return costs


@dataclasses.dataclass(frozen=True)
class Choice:
    depth: int
    how: str                             # for the stats line
    predicted: dict | None = None        # {g: predicted speedup against ar}
    costs: dict | None = None            # step times measured here


def depth(method: str, build, setting: dict, *, model: str, draft_path: str | None, greedy: bool,
          lookup_switch: int = 0, measure: bool = True) -> Choice:
    """The chain depth for `method`: the speed model's best where a record and this machine's step times exist
    (measuring them once where `measure`), else the data file's. `build(g)`: the method built at depth g with
    everything else as it will run, its model draft always running; `setting`: what that build depends on besides
    the depth, the step times' cache key."""
    fixed = fallback("depth", method)
    if mode() == "fixed":
        return Choice(fixed, f"configs/defaults.yaml: {ENV}=fixed")
    record = acceptance_record(model, method, draft_path, greedy, lookup_switch)
    if record is None:
        return Choice(fixed, "configs/defaults.yaml: no acceptance record for this draft")
    costs = step_costs(method, build, sorted(record), setting, measure=measure)
    if costs is None:
        return Choice(fixed, "configs/defaults.yaml: step times not measured yet")
    g, predicted = speed_model.best_depth(record, costs)
    return Choice(g, f"chosen on this machine, predicted {predicted[g]:.2f}x ar", predicted, costs)
